"""SimCLR's NT-Xent written with exp: -log(exp(pos / t) / sum(exp(sim / t))). Its projections are not
normalised, so one loud clip makes sim / t exceed 88: exp overflows (first in the positives' exp, which
runs first), inf / inf = NaN. The exact form is
cross_entropy over sim / t (a logsumexp)."""
import torch
import torch.nn as nn

CITE = "Lightning-Universe/lightning-bolts#320"
TITLE = "nt_xent_loss numerical instability (exp of the similarities gives nan)"
STEPS, BAD_STEP = 6, 3
TAU = 0.5


class Projector(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, v1, v2):
        return self.net(v1), self.net(v2)


def build():
    model = Projector()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 10, generator=g)
    v1 = x + 0.1 * torch.randn(6, 10, generator=g)
    v2 = x + 0.1 * torch.randn(6, 10, generator=g)
    if step == BAD_STEP:
        v1[3] *= 30.0  # a clip recorded with the gain up
        v2[3] *= 30.0
    return (v1, v2), torch.zeros(6)


def loss_fn(z, _):
    z1, z2 = z
    sim = z1 @ z2.t() / TAU
    pos = torch.exp(sim.diagonal())  # CULPRIT
    neg = torch.exp(sim).sum(-1)
    return -torch.log(pos / neg).mean()
