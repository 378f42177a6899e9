"""A topic model's Dirichlet prior (torch.distributions.Dirichlet, concentration < 1) scored on topic proportions
from a softmax: an unscaled document drives one proportion to exactly 0, where the log-density
xlogy(alpha - 1, 0) is +inf and the loss -inf."""
import torch
import torch.nn as nn
from torch.distributions import Dirichlet

CITE = "pyro-ppl/pyro#1983"
TITLE = "Boundary values in a Dirichlet sample cause score error (log_prob at a zero component)"
STEPS, BAD_STEP = 6, 3
TOPICS = 5


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, TOPICS))

    def forward(self, bow):
        return torch.softmax(self.net(bow), -1)


def build():
    model = Encoder()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    bow = torch.rand(8, 12, generator=g)
    if step == BAD_STEP:
        bow[6] *= 2000.0  # raw counts of a long document, not normalised
    return bow, torch.rand(8, 12, generator=g)


def loss_fn(theta, bow):
    prior = Dirichlet(torch.full((TOPICS,), 0.3))
    return -prior.log_prob(theta).mean()  # CULPRIT
