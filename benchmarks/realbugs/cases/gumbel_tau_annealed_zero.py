"""A categorical VAE whose Gumbel-softmax temperature is annealed linearly with no floor: the step where the
schedule reaches tau = 0 divides the perturbed logits by zero inside F.gumbel_softmax, softmax(Inf - Inf) is NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "pytorch/pytorch#184031"
TITLE = "torch.nn.functional.gumbel_softmax returns NaN when tau=0 (division by zero)"
STEPS, BAD_STEP = 6, 4
TAU0, DECAY = 1.0, 0.25


class CategoricalVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(12, 10)
        self.dec = nn.Linear(10, 12)

    def forward(self, x, tau):
        logits = self.enc(x)
        z = F.gumbel_softmax(logits, tau=tau, hard=True)  # CULPRIT
        return self.dec(z)


def build():
    model = CategoricalVAE()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 12, generator=g)
    tau = max(TAU0 - DECAY * step, 0.0)  # the annealing schedule: 0 from step 4 on
    return (x, tau), x


loss_fn = F.mse_loss
