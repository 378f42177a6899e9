"""Keras' L2 normalisation fast path: x * rsqrt(sum(x^2)) of a zero vector (rsqrt(0) = inf, 0 * inf = NaN)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "keras-team/keras#23075"
TITLE = "ops.normalize(order=2) yields NaN gradients for zero vectors on the torch backend"
STEPS, BAD_STEP = 6, 3


def l2_normalize(x, epsilon=1e-12):
    square_sum = torch.sum(torch.square(x), dim=-1, keepdim=True)
    inv_norm = torch.rsqrt(square_sum)  # CULPRIT
    inv_norm = torch.minimum(inv_norm, torch.tensor(1.0 / epsilon))
    return x * inv_norm


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.cls = nn.Linear(8, 3)

    def forward(self, x):
        return self.cls(l2_normalize(self.proj(x)))


def build():
    model = Embed()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 8, generator=g)
    if step == BAD_STEP:
        x[4] = 0.0  # a padding row
    return x, torch.randint(0, 3, (5,), generator=g)


loss_fn = F.cross_entropy
