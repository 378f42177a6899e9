"""Real loops whose gradients die, vanish, spike or are cut, after public threads and the seed ("Debugging Gradients
That Misbehave"), for benchmarks/flow_applied.py. `python cases.py FOLDER NAME` trains NAME under NanGuard and prints
one JSON line: the snapshots written (in step order), the losses, and the share of steps on which some trained
parameter's gradient was exactly zero or None. Each loop's bug sits on a line ending in `# BUG`."""

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard

RELU_LR = 1.0
RNN_LR = 0.05
SPIKE_LR = 0.7


def data(step, n=32, d=8):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, d, generator=g)
    return x, (x[:, :2].sum(1, keepdim=True) * 3 + 5)


class ReluMLP(nn.Module):  # dying ReLU from a too-high rate (PyTorch forums: "all ReLU outputs zero after a few steps")
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        return self.out(h)


class DeepSigmoid(nn.Module):  # the textbook vanishing gradient: 12 sigmoid layers
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(12))
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.sigmoid(layer(x))  # BUG
        return self.out(x)


class LongRNN(nn.Module):  # a plain tanh RNN on 200-step sequences, judged on the first input only
    def __init__(self, scale=1.0):
        super().__init__()
        self.rnn, self.out = nn.RNN(1, 16, batch_first=True), nn.Linear(16, 1)
        with torch.no_grad():
            self.rnn.weight_hh_l0.mul_(scale)

    def forward(self, x):
        h, _ = self.rnn(x)  # BUG
        return self.out(h[:, -1])


def seq(step, n=16, t=200):
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(n, t, 1, generator=g)
    return x, x[:, :1, 0] * 2


class DataCut(nn.Module):  # a custom layer that reads `.data` (a cut in the middle of the model)
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(F.linear(h, self.fc2.weight.data, self.fc2.bias))  # BUG
        return self.out(h)


class Quantized(nn.Module):  # a round() in the path: fake quantisation without a straight-through estimator
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        q = torch.round(self.enc(x) * 4) / 4  # BUG
        return self.dec(q)


class UnusedBranch(nn.Module):  # an auxiliary head computed and never used: must NOT fire
    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        self.last_aux = self.aux(h)  # computed, not in the loss
        return self.head(h)


class SaturatedOut(nn.Module):  # probabilities from a sigmoid fed to BCE; a large bias init saturates the output
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 16), nn.Linear(16, 1)
        with torch.no_grad():
            self.out.bias.fill_(40.0)  # sigmoid(40) is exactly 1.0 in float32

    def forward(self, x):
        return torch.sigmoid(self.out(torch.relu(self.fc(x))))  # BUG


class TanhNet(nn.Module):  # a rate a little too high for SGD: the loss climbs for many steps, the norm spikes
    def __init__(self):
        super().__init__()
        self.fc1, self.out = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.fc1(x)))


def reg_data(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 4, generator=g)
    return x, x[:, :1] * 2 + 0.1 * torch.randn(32, 1, generator=g)


def bce(p, y):
    return F.binary_cross_entropy(p, y)


def cls_data(step, n=32):
    g = torch.Generator().manual_seed(3000 + step)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :1] > 0).float()


CASES = {  # name: (model, optimizer, loss, batches, steps, guard options)
    "relu_high_lr": (ReluMLP, lambda p: torch.optim.Adam(p, lr=RELU_LR), F.mse_loss, data, 30, {}),
    "deep_sigmoid": (DeepSigmoid, lambda p: torch.optim.SGD(p, lr=0.1), F.mse_loss, data, 80, {}),
    "long_rnn": (LongRNN, lambda p: torch.optim.SGD(p, lr=0.01), F.mse_loss, seq, 48, {}),
    # the same RNN with its recurrent weight initialised 3x too large, no clipping, the spike trigger on
    "rnn_saturated_init": (lambda: LongRNN(3.0), lambda p: torch.optim.SGD(p, lr=RNN_LR), F.mse_loss, seq, 30,
                           {"spike_factor": 10.0}),
    "data_cut": (DataCut, lambda p: torch.optim.Adam(p, lr=1e-2), F.mse_loss, data, 6, {}),
    "round_path": (Quantized, lambda p: torch.optim.Adam(p, lr=1e-2), F.mse_loss, data, 6, {}),
    "unused_branch": (UnusedBranch, lambda p: torch.optim.Adam(p, lr=1e-2), F.mse_loss, data, 20, {}),
    "sigmoid_output": (SaturatedOut, lambda p: torch.optim.SGD(p, lr=0.1), bce, cls_data, 8, {}),
    "lr_spike": (TanhNet, lambda p: torch.optim.SGD(p, lr=SPIKE_LR), F.mse_loss, reg_data, 30,
                 {"spike_factor": 10.0}),
}


def train(folder, name):
    make, make_opt, loss_fn, batches, steps, opts = CASES[name]
    torch.manual_seed(0)
    model = make()
    opt = make_opt(model.parameters())
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder, **opts)
    losses, zero = [], 0
    for step in range(steps):
        x, y = batches(step)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        losses.append(loss.item())
        if not guard.loss_ok(loss):
            break
        loss.backward()
        zero += any(p.grad is None or not p.grad.any() for n, p in model.named_parameters() if not n.startswith("aux"))
        guard.grads_ok()
        opt.step()
    snaps = sorted(guard.snapshots + guard.flow_snapshots + guard.spike_snapshots, key=lambda p: p.rsplit("/", 1)[-1])
    return {"snapshots": snaps, "losses": losses, "zero_steps": zero / max(1, len(losses))}


if __name__ == "__main__":
    print(json.dumps(train(sys.argv[1], sys.argv[2])))
