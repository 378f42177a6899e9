"""Small models that reproduce the seed document's catalogue of NaN/Inf sources.

Each factory takes no arguments (what `--model sample_snapshots.models:NAME`
needs); `make_samples.py` trains each briefly and writes the snapshot.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TripletEmbedder(nn.Module):
    """Metric learning: Euclidean distance between embeddings. Identical pairs -> sqrt(0)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, anchor, positive):
        a, p = self.encoder(anchor), self.encoder(positive)
        d = ((a - p) ** 2).sum(-1).sqrt()
        return d.mean()


class PoissonHead(nn.Module):
    """Count regression with a ReLU rate: a dead unit gives rate 0 and log(0) = -inf."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.rate = nn.Linear(16, 1)
        nn.init.constant_(self.rate.bias, 1.0)  # start with a positive rate everywhere

    def forward(self, x, counts):
        lam = F.relu(self.rate(self.body(x))).squeeze(-1)
        return (lam - counts * torch.log(lam)).mean()


class StdScaler(nn.Module):
    """Scales features by sqrt of a learned variance that can go negative."""

    def __init__(self):
        super().__init__()
        self.var = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        nn.init.constant_(self.var.bias, 1.0)  # variances start positive

    def forward(self, x):
        scale = torch.sqrt(self.var(x))
        return self.head(x * scale).squeeze(-1)


class CosineRetriever(nn.Module):
    """Normalises query embeddings by their norm: an all-zero query gives 0/0."""

    def __init__(self):
        super().__init__()
        self.query = nn.Linear(12, 6, bias=False)
        self.keys = nn.Parameter(torch.randn(10, 6))

    def forward(self, q):
        e = self.query(q)
        e = e / e.norm(dim=-1, keepdim=True)
        return e @ F.normalize(self.keys, dim=-1).t()


class EntropyRegularised(nn.Module):
    """A gating network with an entropy bonus -sum p log p; sparse (ReLU) gates give 0 * log(0)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(10, 5)
        self.out = nn.Linear(10, 1)
        nn.init.constant_(self.gate.bias, 2.0)  # every gate starts open

    def forward(self, x):
        g = F.relu(self.gate(x))
        p = g / (g.sum(-1, keepdim=True) + 1e-6)
        entropy = -(p * torch.log(p)).sum(-1)
        return (self.out(x).squeeze(-1) - 0.1 * entropy).pow(2).mean()


class OverconfidentClassifier(nn.Module):
    """log(softmax(logits)) instead of log_softmax: confident logits underflow softmax to exactly 0."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return torch.log(torch.softmax(self.net(x), dim=-1))


class HalfMLP(nn.Module):
    """An MLP trained in pure float16: activations grow past 65504 and the matmul overflows."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        return self.head(h).squeeze(-1)


def triplet() -> nn.Module:
    return TripletEmbedder()


def poisson() -> nn.Module:
    return PoissonHead()


def std_scaler() -> nn.Module:
    return StdScaler()


def retriever() -> nn.Module:
    return CosineRetriever()


def entropy_gate() -> nn.Module:
    return EntropyRegularised()


def overconfident() -> nn.Module:
    return OverconfidentClassifier()


def half_mlp() -> nn.Module:
    return HalfMLP().half()
