"""DE-ViT's mask loss: loss.sum() / num_masks when a crop holds no mask (0 / 0)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "mlzxy/devit#51"
TITLE = "division by zero if no masks"
STEPS, BAD_STEP = 6, 3


def build():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 3, 8, 8, generator=g)
    valid = torch.ones(4, dtype=torch.bool)
    if step == BAD_STEP:
        valid[:] = False  # a crop with no annotated instance
    return x, ((torch.rand(4, 1, 8, 8, generator=g) > 0.5).float(), valid)


def loss_fn(logits, target):
    masks, valid = target
    num_masks = valid.sum()
    loss = F.binary_cross_entropy_with_logits(logits[valid], masks[valid], reduction="none").mean((1, 2, 3))
    return loss.sum() / num_masks  # CULPRIT
