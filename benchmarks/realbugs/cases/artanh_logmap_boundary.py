"""A hyperbolic layer (HGCN style): expmap0 puts a feature on the Poincare ball, tanh(|v|) v/|v|, and logmap0
brings it back, artanh(|x|) x/|x|. For |v| > 9 tanh rounds to 1.0 in float32 and artanh(1) = inf: an
unnormalised feature row makes the layer's output infinite."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "dalab/hyperbolic_nn#3"
TITLE = "log_0 function: artanh(sqrt(c)|y|) is infinite when sqrt(c)|y| reaches 1"
STEPS, BAD_STEP = 6, 3


class HypLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        v = self.lin(x)
        vn = v.norm(dim=-1, keepdim=True)
        h = torch.tanh(vn) * v / vn
        hn = h.norm(dim=-1, keepdim=True)
        t = torch.atanh(hn) * h / hn  # CULPRIT
        return self.out(t).squeeze(-1)


def build():
    model = HypLinear()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g)
    if step == BAD_STEP:
        x[4] *= 40.0  # a node whose raw degree features were not normalised
    return x, torch.randn(8, generator=g)


def loss_fn(pred, y):
    return F.mse_loss(pred, y)
