"""A feature-diversity regulariser, the std written as var().sqrt() (torch.std itself now returns a zero gradient
there): identical features across the batch (std = 0) give a NaN gradient (the derivative of sqrt at 0)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "pytorch/pytorch#4320"
TITLE = "torch.std NaN gradient"
STEPS, BAD_STEP = 6, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.cls = nn.Linear(8, 3)

    def forward(self, x):
        h = self.enc(x)
        return self.cls(h), h


def build():
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g)
    if step == BAD_STEP:
        x[:] = x[0]  # a batch of duplicates (one cached sample repeated)
    return x, torch.randint(0, 3, (8,), generator=g)


def loss_fn(out, y):
    logits, h = out
    diversity = h.var(0).sqrt().mean()  # CULPRIT
    return F.cross_entropy(logits, y) - 0.1 * diversity
