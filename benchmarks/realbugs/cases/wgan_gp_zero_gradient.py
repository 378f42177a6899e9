"""WGAN-GP's gradient penalty with the norm written as sqrt(sum(grad^2)) (the keras.io example's form): a sample
where the critic is flat (every Hardtanh unit saturated by an unscaled input) has an input gradient of exactly
zero, and sqrt's derivative at 0 makes the penalty's own gradient Inf / NaN."""
import torch
import torch.nn as nn

CITE = "keras-team/keras-io#910"
TITLE = "A bug causing gradient to NaN in WGAN-gp example (sqrt of the squared gradient norm at 0)"
STEPS, BAD_STEP = 6, 3


class CriticWithPenalty(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(8, 32), nn.Hardtanh(), nn.Linear(32, 1))

    def forward(self, real, fake, eps):
        mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
        grads = torch.autograd.grad(self.critic(mixed).sum(), mixed, create_graph=True)[0]
        norm = torch.sqrt((grads ** 2).sum(dim=1))  # CULPRIT
        penalty = ((norm - 1) ** 2).mean()
        return self.critic(fake).mean() - self.critic(real).mean() + 10.0 * penalty


def build():
    model = CriticWithPenalty()
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def batch(step):
    g = torch.Generator().manual_seed(step)
    real, fake = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    if step == BAD_STEP:
        real[2] = 1e4 * real[2].sign()  # an unscaled sample: every unit of the critic saturates
        fake[2] = real[2]
    return (real, fake, torch.rand(6, 1, generator=g)), None
