"""A fix that only silences the bug (o-verified's control, no issue thread): vae_logvar_exp's VAE and its unscaled
row, trained with plain SGD. A clamp of the log-variance makes the step finite, but the row is 5e3 times the
others: its reconstruction gradient is ~1e17 and SGD steps with it, so the next steps overflow again. The clamp
must not be verified."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "control: vae_logvar_exp with SGD"
TITLE = "A clamp that silences an unscaled input (wrong when applied)"
STEPS, BAD_STEP = 6, 3


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.mu = nn.Linear(16, 4)
        self.logvar = nn.Linear(16, 4)
        self.dec = nn.Linear(4, 8)

    def forward(self, x, eps):
        h = F.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        std = torch.exp(0.5 * logvar)  # CULPRIT
        z = mu + eps * std
        return self.dec(z), mu, logvar


def build():
    model = VAE()
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 8, generator=g)
    if step == BAD_STEP:
        x[0] *= 5e3  # a row with an unscaled column
    return (x, torch.randn(6, 4, generator=g)), x


def loss_fn(out, x):
    recon, mu, logvar = out
    kld = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
    return F.mse_loss(recon, x) + kld
