"""A pointer-generator's output: log(p * softmax(x1) + (1 - p) * softmax(x2)) where both softmaxes underflow."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "pytorch/pytorch#1620"
TITLE = "nn.Log: log of a mixture of softmaxes gives nan gradients"
STEPS, BAD_STEP = 6, 3


class Pointer(nn.Module):
    def __init__(self):
        super().__init__()
        self.gen = nn.Linear(8, 5)
        self.copy = nn.Linear(8, 5)
        self.gate = nn.Linear(8, 1)

    def forward(self, x):
        p = torch.sigmoid(self.gate(x))
        return p * F.softmax(self.gen(x), -1) + (1 - p) * F.softmax(self.copy(x), -1)


def build():
    model = Pointer()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch(step, model):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=g)
    y = torch.randint(0, 5, (4,), generator=g)
    if step == BAD_STEP:
        x[0] *= 1e4  # an outlier: both distributions put ~0 on the target word
        with torch.no_grad():
            y[0] = model(x[:1]).argmin()
    return x, y


def loss_fn(probs, y):
    return F.nll_loss(torch.log(probs), y)  # CULPRIT
