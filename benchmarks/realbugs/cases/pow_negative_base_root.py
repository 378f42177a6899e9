"""A regressor whose loss compares magnitudes under a 13th-root compression, written (p + 1).pow(1/13) - 1 as in
the thread: a prediction below -1 makes the base negative, a negative base to a fractional power is NaN in torch
(numpy agrees), and the loss is NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "pytorch/pytorch#131039"
TITLE = "result in nan when computing pow of a tensor"
STEPS, BAD_STEP = 6, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        return self.fc(x).squeeze(1)


def build():
    model = Net()
    with torch.no_grad():
        model.fc[2].bias.fill_(1.0)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(12, 6, generator=g)
    if step == BAD_STEP:
        x[2] = 40.0 * x[2]  # an unscaled outlier: its prediction falls below -1
    return x, torch.rand(12, generator=g) * 3.0


def loss_fn(p, y):
    pc = (p + 1).pow(1 / 13) - 1  # CULPRIT
    yc = (y + 1).pow(1 / 13) - 1
    return F.mse_loss(pc, yc)
