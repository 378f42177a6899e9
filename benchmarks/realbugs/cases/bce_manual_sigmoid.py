"""BCE written out on sigmoid probabilities: a saturated sigmoid gives p = 1 exactly, log(1 - p) = -inf, and
(1 - y) * -inf = NaN for a positive label."""
import torch
import torch.nn as nn

CITE = "pytorch/pytorch#24933"
TITLE = "BCELossWithLogits(input) != BCELoss(Sigmoid(input)): log(0) of a saturated sigmoid"
STEPS, BAD_STEP = 6, 3


def build():
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g)
    if step == BAD_STEP:
        x[1] *= 1e5  # an unnormalised sample (a raw sensor reading)
    return x, (torch.rand(8, 1, generator=g) > 0.5).float()


def loss_fn(p, y):
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # CULPRIT
