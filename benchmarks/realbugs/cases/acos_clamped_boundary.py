"""An angle between unit vectors: acos(cos.clamp(-1, 1)) is finite in forward, but AcosBackward is -inf at
cos = 1 (two identical directions) and the gradient becomes NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "banctilrobitaille/torch-vectorized#7"
TITLE = "RuntimeError: Function 'AcosBackward' returned nan values in its 0th output"
STEPS, BAD_STEP = 6, 3


class Directions(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(3, 3)

    def forward(self, x):
        return F.normalize(self.net(x), dim=-1)


def build():
    model = Directions()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step, model):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 3, generator=g)
    with torch.no_grad():
        t = F.normalize(torch.randn(6, 3, generator=g), dim=-1)
        if step == BAD_STEP:
            t[1] = model(x)[1]  # the prediction is exactly the target direction
    return x, t


def loss_fn(pred, t):
    cos = (pred * t).sum(-1).clamp(-1.0, 1.0)
    return torch.acos(cos).mean()  # CULPRIT
