"""A count decoder (scVI-style) with the negative binomial's total_count (inverse dispersion) from softplus: a
cell with out-of-range covariates drives the dispersion head below -104, softplus underflows to exactly 0, and
NegativeBinomial.log_prob evaluates lgamma(total_count) = lgamma(0) = Inf (digamma(0) in the backward)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import NegativeBinomial

CITE = "OmicsML/dance#166"
TITLE = "Fix scmm error due to zero total counts calling torch.lgamma (called by torch.distributions.NegativeBinomial)"
STEPS, BAD_STEP = 6, 3


class CountDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.logits = nn.Linear(16, 10)
        self.disp = nn.Linear(4, 10)

    def forward(self, cov, counts):
        theta = F.softplus(self.disp(cov))
        nb = NegativeBinomial(total_count=theta, logits=self.logits(self.hidden(cov)), validate_args=False)
        return nb.log_prob(counts).sum(-1)  # CULPRIT


def build():
    model = CountDecoder()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    cov = torch.randn(8, 4, generator=g)
    counts = torch.poisson(torch.full((8, 10), 3.0), generator=g) + 1
    if step == BAD_STEP:
        cov[5] = -400.0 * model_sign()  # a cell whose covariates were never standardised
    return (cov, counts), None


def model_sign():
    torch.manual_seed(0)  # the same initial weights build() gets: push the dispersion head far below -104
    return CountDecoder().disp.weight.sum(0).sign()


def loss_fn(ll, _):
    return -ll.mean()
