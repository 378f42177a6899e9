"""kornia's binary focal loss with gamma = 0.5: torch.pow(1 - p, gamma) at p = 1 (a saturated sigmoid)."""
import torch
import torch.nn as nn

CITE = "kornia/kornia#918"
TITLE = "NaN gradients on backward pass with focal loss (0 < gamma < 1)"
STEPS, BAD_STEP = 6, 3


def binary_focal_loss_with_logits(logits, target, alpha=0.25, gamma=0.5, eps=1e-8):
    probs = torch.sigmoid(logits)
    loss_tmp = -alpha * torch.pow(1.0 - probs, gamma) * target * torch.log(probs + eps) \
        - (1 - alpha) * torch.pow(probs, gamma) * (1.0 - target) * torch.log(1.0 - probs + eps)  # CULPRIT
    return loss_tmp.mean()


def build():
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    if step == BAD_STEP:
        x[0] *= 1e4  # a confident sample: its logit saturates the sigmoid
    return x, (torch.rand(8, 1, generator=g) > 0.5).float()


loss_fn = binary_focal_loss_with_logits
