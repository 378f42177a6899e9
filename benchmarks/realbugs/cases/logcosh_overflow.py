"""The log-cosh regression loss written as its definition, log(cosh(pred - target)): cosh overflows to inf
in float32 for a residual above 89, so one outlier target makes the loss inf. The exact form is
logaddexp(d, -d) - log(2) (or |d| + softplus(-2|d|) - log 2)."""
import torch
import torch.nn as nn

CITE = "Lightning-AI/torchmetrics#3488"
TITLE = "LogCoshError returns inf for finite large residuals"
STEPS, BAD_STEP = 6, 3


def build():
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 5, generator=g)
    y = torch.randn(8, 1, generator=g)
    if step == BAD_STEP:
        y[2] = 150.0  # a mislabelled target in raw units
    return x, y


def loss_fn(pred, y):
    return torch.log(torch.cosh(pred - y)).mean()  # CULPRIT
