"""DLRM-style MLP whose bias initialisation can put a layer's biases far below zero: every ReLU of the bottom
layer is negative for every input, its output is 0, and the bottom layer's weights and biases get exactly zero
gradient from the first step on (the loss does not train them, nothing is NaN)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "facebookresearch/dlrm#358"
TITLE = "Bias initialized to a large negative value: negative input to ReLU, all derivatives zero, no training"
STEPS, BAD_STEP = 8, 0


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.bot = nn.Linear(8, 16)
        self.top = nn.Linear(16, 1)

    def forward(self, x):
        return self.top(torch.relu(self.bot(x)))  # CULPRIT


def build():
    model = MLP()
    with torch.no_grad():
        model.bot.bias.normal_(-6.0, 0.5)  # the initialisation the thread reports
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :1] * 2 + 1


loss_fn = F.mse_loss
