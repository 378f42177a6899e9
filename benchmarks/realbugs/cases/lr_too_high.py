"""A VAE trained with too high a learning rate: the loss climbs step by step until it overflows."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "AntixK/PyTorch-VAE#16"
TITLE = "Nan in loss function in TC-Beta VAE (kld grows from ~2000 to inf in a few steps: reduce the learning rate)"
STEPS, BAD_STEP = 40, 40
EXPECT_CAUSES = ("training_diverged",)  # the fix is the run's learning rate, not a line of the step


class AE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 4)
        self.dec = nn.Linear(4, 8)

    def forward(self, x):
        return self.dec(torch.relu(self.enc(x)))


def build():
    model = AE()
    return model, torch.optim.SGD(model.parameters(), lr=3.0)  # CULPRIT


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g) * 3
    return x, x


loss_fn = F.mse_loss
