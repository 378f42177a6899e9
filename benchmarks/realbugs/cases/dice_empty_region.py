"""A Dice loss restricted to a region of interest: 2|P∩T| / (|P| + |T|) over an empty region (0 / 0)."""
import torch
import torch.nn as nn

CITE = "Project-MONAI/MONAI#120"
TITLE = "MeanDice returns NaN for an all-zero label"
STEPS, BAD_STEP = 6, 3


def build():
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2, 1, 8, 8, generator=g)
    target = (torch.rand(2, 1, 8, 8, generator=g) > 0.7).float()
    roi = torch.zeros(2, 1, 8, 8)
    roi[..., 2:6, 2:6] = 1
    if step == BAD_STEP:
        roi[1] = 0  # a slice outside the organ: an empty region of interest
    return x, (target, roi)


def loss_fn(logits, target):
    t, roi = target
    p = torch.sigmoid(logits) * roi
    t = t * roi
    inter = (p * t).sum((1, 2, 3))
    dice = 2 * inter / (p.sum((1, 2, 3)) + t.sum((1, 2, 3)))  # CULPRIT
    return (1 - dice).mean()
