"""A tanh regression trained by SGD at a rate far too high (`LR = 4.0`, a named constant): the loss climbs for
several steps, the tanh units saturate, and the first layer's gradient dies (exactly zero) before the loss goes
non-finite (tests/flow/test_divergence.py). `python divtrain.py FOLDER` trains it under NanGuard and prints one JSON
line: the snapshots, the dead-gradient ones, the losses, and whether fc1's gradient was ever exactly zero."""

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard

LR = 4.0
STEPS = 30


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.out = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))  # TANH
        return self.out(h)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 4, generator=g)
    return x, x[:, :1] * 2 + 0.1 * torch.randn(32, 1, generator=g)


def main(folder):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder)
    losses, died = [], False
    for step in range(STEPS):
        x, y = batch(step)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        if not guard.loss_ok(loss):
            break
        loss.backward()
        died = died or bool((model.fc1.weight.grad == 0).all())
        guard.grads_ok()
        opt.step()
    print(json.dumps({"snapshots": guard.snapshots + guard.flow_snapshots, "flow": guard.flow_snapshots,
                      "losses": losses, "died": died}))


if __name__ == "__main__":
    main(sys.argv[1])
