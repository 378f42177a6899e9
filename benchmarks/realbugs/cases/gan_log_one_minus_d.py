"""A GAN trained with the minimax losses written on the discriminator's sigmoid output: log(D(x)) and
log(1 - D(G(z))). A generated sample the discriminator takes for real with certainty drives its logit past ~17,
the sigmoid rounds to exactly 1.0 in float32, and log(1 - D(G(z))) = log(0) = -Inf."""
import torch
import torch.nn as nn

CITE = "soumith/ganhacks#67"
TITLE = "Discriminator loss goes to zero / NaN with a sigmoid output layer and BCELoss; use logits (BCEWithLogitsLoss)"
STEPS, BAD_STEP = 6, 3


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, real, fake):
        d_real = torch.sigmoid(self.net(real))
        d_fake = torch.sigmoid(self.net(fake))
        return d_real, d_fake


def build():
    model = Discriminator()
    return model, torch.optim.Adam(model.parameters(), lr=2e-4)


def batch(step, model):
    g = torch.Generator().manual_seed(step)
    real, fake = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g) + 0.5
    if step == BAD_STEP:  # a generated sample far along the direction the discriminator scores as real
        with torch.no_grad():
            w = model.net[2].weight @ model.net[0].weight
        fake[4] = 200.0 * w.flatten().sign()
    return (real, fake), None


def loss_fn(out, _):
    d_real, d_fake = out
    return -(torch.log(d_real) + torch.log(1 - d_fake)).mean()  # CULPRIT
