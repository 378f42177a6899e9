"""A count regressor trained with PoissonNLLLoss(log_input=False) on the raw output of a Linear head (no softplus):
the loss computes input - target * log(input + eps), so the first batch that drives a predicted rate below -eps
takes the log of a negative number and the loss is NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "pytorch/pytorch#184030"
TITLE = "torch.nn.PoissonNLLLoss returns NaN for negative input when log_input=False"
STEPS, BAD_STEP = 6, 3


class CountNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 16), nn.ReLU())
        self.rate = nn.Linear(16, 1)

    def forward(self, x):
        return self.rate(self.body(x)).squeeze(1)


def build():
    model = CountNet()
    with torch.no_grad():
        model.rate.bias.fill_(3.0)  # rates start near the counts' mean
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 5, generator=g)
    if step == BAD_STEP:
        x[4] = -40.0 * x[4]  # an unscaled feature row: the head's output swings far below 0
    with torch.no_grad():
        y = torch.poisson(torch.full((16,), 3.0), generator=g)
    return x, y


def loss_fn(rate, y):
    return F.poisson_nll_loss(rate, y, log_input=False)  # CULPRIT
