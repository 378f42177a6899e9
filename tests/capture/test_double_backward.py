"""Issue 38: a step that differentiates a gradient (`torch.autograd.grad(..., create_graph=True)`) runs the
activations' and losses' derivative kernels (`hardtanh_backward`, `gelu_backward`, `sigmoid_backward`,
`mse_loss_backward`, ...) as forward ops. They are on the allowlist (with their checks in formats/opchecks.py), so
the snapshot carries its step program and is analyzed with no flags where the training code is not importable.

* WGAN-GP (keras-io#910): a sample that saturates every Hardtanh unit of the critic has an input gradient of
  exactly zero; the penalty's norm, written as sqrt(sum(g^2)), has an infinite derivative there;
* an input-gradient regulariser on a regression net (SiLU, a Sigmoid output, MSE): a saturated output makes the
  same zero gradient, through sigmoid_backward and mse_loss_backward.
"""

from __future__ import annotations

from isolation import marker_line, program_ops, train_then_analyze

TRAINING = r'''
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from nanreplay import NanGuard


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Hardtanh(), nn.Linear(16, 1))

    def forward(self, real, fake, eps):
        mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
        g = torch.autograd.grad(self.net(mixed).sum(), mixed, create_graph=True)[0]
        norm = torch.sqrt((g ** 2).sum(dim=1))  # LINE: wgan
        return self.net(fake).mean() - self.net(real).mean() + 10.0 * ((norm - 1) ** 2).mean()


class Smooth(nn.Module):
    """A regression net whose loss carries the norm of its input gradient (a smoothness regulariser)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.SiLU(), nn.Linear(16, 1), nn.Sigmoid())

    def forward(self, x, y):
        x = x.requires_grad_(True)
        fit = F.mse_loss(self.net(x), y)
        g = torch.autograd.grad(fit, x, create_graph=True)[0]
        return fit + 0.1 * torch.sqrt((g ** 2).sum(dim=1)).mean()  # LINE: smooth


def wgan(folder):
    torch.manual_seed(0)
    model = Critic()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    guard = NanGuard(model, opt, folder=folder)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        real, fake, eps = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.rand(6, 1, generator=g)
        if step == 2:
            real[2] = 1e4 * real[2].sign()  # an unscaled sample: every Hardtanh unit saturates
            fake[2] = real[2]
        guard.begin((real, fake, eps), step=step)
        opt.zero_grad()
        if not guard.step(model(real, fake, eps)):
            break
    return guard.last_snapshot


def smooth(folder):
    torch.manual_seed(0)
    model = Smooth()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, folder=folder)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randn(8, 4, generator=g), torch.rand(8, 1, generator=g)
        if step == 2:
            x[3] = 1e4  # a raw reading: the Sigmoid output saturates and its input gradient is exactly zero
        guard.begin((x, y), step=step)
        opt.zero_grad()
        if not guard.step(model(x, y)):
            break
    return guard.last_snapshot


if __name__ == "__main__":
    for kind in sys.argv[2:]:
        print(kind, {"wgan": wgan, "smooth": smooth}[kind](f"{sys.argv[1]}/{kind}"))
'''




def test_double_backward_steps_record_and_localise(tmp_path):
    runs = train_then_analyze(tmp_path, TRAINING, ("wgan", "smooth"))
    want = {"wgan": {"aten.hardtanh_backward.default", "aten.gelu_backward.default"},
            "smooth": {"aten.sigmoid_backward.default", "aten.mse_loss_backward.default"}}
    for kind, (path, d) in runs.items():
        assert want[kind] <= program_ops(path), kind
        c = d["culprit"]
        assert d["verdict"] == "culprit_found", (kind, d["verdict"])
        assert c["source"]["file"].endswith("trainmod.py") and c["source"]["line"] == marker_line(TRAINING, kind), c
        assert d["diagnosis"]["cause"] == "sqrt_at_zero", (kind, d["diagnosis"]["cause"])
        fix = d["diagnosis"]["fix"]
        assert fix["kind"] == "epsilon" and fix["verified"], (kind, fix)
