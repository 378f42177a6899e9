"""A mixture density network's NLL: -log(sum(pi * N(y; mu, sigma))) underflows to log(0) for an outlier target."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "keras-team/keras#2586"
TITLE = "Mixture Density Network quickly gets to nan loss"
STEPS, BAD_STEP = 6, 3
K = 3


class MDN(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.Sequential(nn.Linear(2, 16), nn.Tanh())
        self.pi = nn.Linear(16, K)
        self.mu = nn.Linear(16, K)
        self.sigma = nn.Linear(16, K)

    def forward(self, x):
        h = self.h(x)
        return F.softmax(self.pi(h), -1), self.mu(h), torch.exp(self.sigma(h))


def build():
    model = MDN()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 2, generator=g)
    y = torch.randn(8, 1, generator=g)
    if step == BAD_STEP:
        y[3] = 40.0  # an outlier target
    return x, y


def loss_fn(out, y):
    pi, mu, sigma = out
    dens = torch.exp(-0.5 * ((y - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    return -torch.log((pi * dens).sum(-1)).mean()  # CULPRIT
