"""Gumbel-perturbed scores written -log(-log(u)) on uniform noise, as in AutoCF: a noise value of exactly 0 gives
log(0) = -inf, then -log(inf) = -inf on that score; the loss, a log-softmax over the perturbed scores gathered at
the positive item, is inf."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "HKUDS/SSLRec#26"
TITLE = "Gumbel noise computation can produce -inf (infoloss becomes inf)"
STEPS, BAD_STEP = 6, 3


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Linear(8, 16)
        self.items = nn.Parameter(torch.randn(10, 16) * 0.3)

    def forward(self, x, noise):
        scores = self.user(x) @ self.items.t()
        gumbel = -torch.log(-torch.log(noise))  # CULPRIT
        return F.log_softmax(scores + gumbel, dim=1)


def build():
    model = Scorer()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 8, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    noise = torch.rand(8, 10, generator=g)  # the sampler's uniform noise, in [0, 1)
    if step == BAD_STEP:
        noise[3, y[3]] = 0.0  # a draw of exactly 0 (t.rand can return it)
    return (x, noise), y


def loss_fn(logp, y):
    return F.nll_loss(logp, y)
