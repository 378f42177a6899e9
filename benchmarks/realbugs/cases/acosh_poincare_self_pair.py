"""Poincare-ball embeddings trained on the distance of related pairs, acosh(1 + 2|u-v|^2 / ((1-|u|^2)(1-|v|^2))).
A pair whose two ends are the same node (a self-loop in the relation file) has argument exactly 1: acosh's
derivative there is 1/sqrt(0) = inf, times the zero gradient of |u-v|^2 at u = v: NaN."""
import torch
import torch.nn as nn

CITE = "SauersML/gam#239"
TITLE = "Poincare distance(a, a): the arccosh argument is exactly 1 for identical points (clamped, derivative polluted)"
STEPS, BAD_STEP = 6, 3


class Poincare(nn.Module):
    def __init__(self, n=12, d=2):
        super().__init__()
        self.emb = nn.Embedding(n, d)
        nn.init.uniform_(self.emb.weight, -0.1, 0.1)

    def forward(self, pairs):
        u, v = self.emb(pairs[:, 0]), self.emb(pairs[:, 1])
        sq = ((u - v) ** 2).sum(-1)
        den = (1 - (u ** 2).sum(-1)) * (1 - (v ** 2).sum(-1))
        return torch.acosh(1 + 2 * sq / den)  # CULPRIT


def build():
    model = Poincare()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    pairs = torch.stack([torch.randint(0, 6, (8,), generator=g), torch.randint(6, 12, (8,), generator=g)], 1)
    if step == BAD_STEP:
        pairs[5, 1] = pairs[5, 0]  # a self-loop in the relation file
    return pairs, torch.zeros(8)


def loss_fn(dist, target):
    return ((dist - target) ** 2).mean()
