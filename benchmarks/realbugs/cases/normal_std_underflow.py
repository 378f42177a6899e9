"""A Gaussian policy whose std = exp(log_std) underflows to exactly 0 in float32 (log_std < -104): the
Normal's log_prob is -(a - mu)^2 / 0 - log(0) = -inf + inf = NaN. rsl_rl turns argument validation off, so
nothing raises before the NaN."""
import torch
import torch.nn as nn
from torch.distributions import Normal

CITE = "leggedrobotics/rsl_rl#190"
TITLE = "Add log_std bounds to Gaussian distributions to prevent std underflow"
STEPS, BAD_STEP = 6, 3


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.mu = nn.Linear(16, 2)
        self.log_std = nn.Linear(4, 2)

    def forward(self, obs, actions):
        std = torch.exp(self.log_std(obs))
        dist = Normal(self.mu(self.body(obs)), std, validate_args=False)
        return dist.log_prob(actions).sum(-1)  # CULPRIT


def build():
    model = Actor()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    obs = torch.randn(8, 4, generator=g)
    if step == BAD_STEP:
        obs[6] = -400.0 * model_sign()  # a sensor glitch: one observation far out of range
    return (obs, torch.randn(8, 2, generator=g)), torch.randn(8, generator=g)


def model_sign():
    torch.manual_seed(0)  # the same initial weights build() gets: push log_std far below -104
    return Actor().log_std.weight.sum(0).sign()


def loss_fn(logp, adv):
    return -(logp * adv).mean()
