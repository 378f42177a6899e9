"""softplus written as log(1 + exp(x)): exp overflows float32 above ~88.7 and the gradient becomes NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "tracel-ai/burn#5373"
TITLE = "softplus overflows to inf for large inputs, producing NaN gradients"
STEPS, BAD_STEP = 6, 3


class PositiveScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        z = self.net(x)
        scale = torch.log(1 + torch.exp(z))  # CULPRIT
        return self.out(scale)


def build():
    model = PositiveScale()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g)
    if step == BAD_STEP:
        x[0] *= 1e4
    return x, torch.randn(8, 1, generator=g)


loss_fn = F.mse_loss
