"""A hyperbolic (Lorentz / hyperboloid) encoder whose exponential map at the origin is written with torch.cosh and
torch.sinh and no clamp of the norm (HGCN's own math_utils clamps it to 15): an input row with a large norm gives a
tangent norm above ~89, cosh and sinh overflow float32 to Inf, and the decoder turns Inf into NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "HazyResearch/hgcn#4"
TITLE = "hyperboloid: the exponential and logarithmic map return a tensor full of NaN values"
STEPS, BAD_STEP = 6, 3


def expmap0(u):
    u_norm = u.norm(dim=-1, keepdim=True).clamp_min(1e-15)
    time = torch.cosh(u_norm)  # CULPRIT
    space = torch.sinh(u_norm) * u / u_norm
    return torch.cat([time, space], dim=-1)


class HyperbolicEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(10, 6)
        self.dec = nn.Linear(7, 3)

    def forward(self, x):
        return self.dec(expmap0(self.enc(x)))


def build():
    model = HyperbolicEncoder()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 10, generator=g)
    if step == BAD_STEP:
        x[6] *= 400.0  # a node whose features were never normalised
    return x, torch.randint(0, 3, (8,), generator=g)


loss_fn = F.cross_entropy
