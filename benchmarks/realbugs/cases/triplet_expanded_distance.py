"""Batch-hard triplet loss with the pairwise distance written as sqrt(|a|^2 + |b|^2 - 2ab) and no clamp or
epsilon: the distance of an embedding to itself (the diagonal, and any two identical samples) is 0 or a rounding
residue, sqrt's derivative there is infinite, and masking the diagonal out by multiplication gives 0 * inf = NaN in
the gradient."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "h1yuol/pytorch-triplet-loss#1"
TITLE = "Reason for adding epsilon before square root operation"
STEPS, BAD_STEP = 6, 0


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.fc(x)


def build():
    model = Embed()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 10, generator=g)
    return x, torch.arange(8) % 4


def loss_fn(e, labels):
    sq = (e * e).sum(1)
    dist = (sq[:, None] + sq[None, :] - 2 * e @ e.t()).sqrt()  # CULPRIT
    same = (labels[:, None] == labels[None, :]).float()
    pos = (dist * same).max(1).values
    neg = (dist + 1e6 * same).min(1).values
    return F.relu(pos - neg + 0.3).mean()
