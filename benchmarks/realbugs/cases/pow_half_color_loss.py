"""Zero-DCE's colour-constancy loss: torch.pow(d, 0.5) of the squared channel differences of a grey image (d = 0)."""
import torch
import torch.nn as nn

CITE = "Li-Chongyi/Zero-DCE_extension#2"
TITLE = "nan loss occur (torch.pow(x, 0.5) in L_color at zero)"
STEPS, BAD_STEP = 6, 3


class Enhance(nn.Module):
    """A light-enhancement curve: one curve parameter per pixel, shared by the three channels."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 3, padding=1)

    def forward(self, x):
        a = torch.tanh(self.conv(x))
        return x + a * x * (1 - x)


def build():
    model = Enhance()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.rand(2, 3, 8, 8, generator=g)
    if step == BAD_STEP:
        x[1] = x[1, :1]  # a grey image: r = g = b
    return x, torch.zeros(2)


def loss_fn(enhanced, _):
    mean_rgb = enhanced.mean((2, 3))
    mr, mg, mb = mean_rgb[:, 0], mean_rgb[:, 1], mean_rgb[:, 2]
    d = (mr - mg) ** 2 + (mr - mb) ** 2 + (mb - mg) ** 2
    k = torch.pow(d, 0.5)  # CULPRIT
    return k.mean() + ((enhanced - 0.6) ** 2).mean()
