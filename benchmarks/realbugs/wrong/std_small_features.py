"""An ε that changes healthy values (o-verified's control, no issue thread): std_constant_features' regulariser on
features of scale 1e-4 (their variances ~1e-9), one feature constant across the bad batch. sqrt(var + ε) with an
ε at float32's usual scale (1e-7 and up) moves every healthy feature's std, and with it every healthy loss.
Such an ε must not be verified; an ε below the variances' scale (or a clamp) would be right."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "control: std_constant_features at a small scale"
TITLE = "An epsilon that changes healthy values (wrong when applied unless it is below the data's scale)"
STEPS, BAD_STEP = 6, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 8)
        self.cls = nn.Linear(8, 3)

    def forward(self, x):
        h = self.enc(x) * 1e-4  # a small-scale embedding
        return self.cls(h * 1e4), h


def build():
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g)
    if step == BAD_STEP:
        x[:] = x[0]  # a batch of duplicates: every feature constant
    return x, torch.randint(0, 3, (8,), generator=g)


def loss_fn(out, y):
    logits, h = out
    diversity = h.var(0).sqrt().mean()  # CULPRIT
    return F.cross_entropy(logits, y) - 100.0 * diversity
