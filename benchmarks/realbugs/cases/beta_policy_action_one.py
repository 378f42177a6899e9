"""A Beta policy (torch.distributions.Beta) trained on actions the environment clipped to exactly 1.0: the
log-density at the edge of the support is -inf (xlogy(a - 1, 1 - x) with a > 1), the loss +inf."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Beta

CITE = "pytorch/pytorch#92260"
TITLE = "distributions.Beta returning incorrect results at 0 and 1 (-inf / nan log_prob)"
STEPS, BAD_STEP = 6, 3


class BetaPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, obs):
        ab = F.softplus(self.net(obs)) + 1.0  # concentrations > 1: a unimodal policy
        return torch.stack([ab[:, 0], ab[:, 1]], -1)


def build():
    model = BetaPolicy()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    obs = torch.randn(8, 4, generator=g)
    actions = torch.rand(8, generator=g) * 0.8 + 0.1
    if step == BAD_STEP:
        actions[5] = 1.0  # the environment clipped the action into [0, 1]
    return obs, (actions, torch.randn(8, generator=g))


def loss_fn(ab, target):
    actions, adv = target
    dist = Beta(ab[:, 0], ab[:, 1])
    return -(dist.log_prob(actions) * adv.abs()).mean()  # CULPRIT
