"""KL-Loss's bounding-box regression with a predicted log-variance alpha: exp(-alpha) overflows for an input the
network maps to a very negative alpha (the thread clipped alpha to (-50, 50))."""
import torch
import torch.nn as nn

CITE = "ethanhe42/KL-Loss#4"
TITLE = "Extra term in the KL-loss code and the NaN problem (exp(-alpha) with a variance close to zero)"
STEPS, BAD_STEP = 6, 3


class BoxHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.box = nn.Linear(16, 4)
        self.alpha = nn.Linear(16, 4)

    def forward(self, x):
        h = self.feat(x)
        return self.box(h), self.alpha(h)


def build():
    model = BoxHead()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 8, generator=g)
    if step == BAD_STEP:
        x[6] *= 1e4  # a proposal with unnormalised features
    return x, torch.randn(8, 4, generator=g)


def loss_fn(out, target):
    box, alpha = out
    d = (box - target).abs()
    loss = torch.exp(-alpha) * 0.5 * d ** 2 + 0.5 * alpha  # CULPRIT
    return loss.mean()
