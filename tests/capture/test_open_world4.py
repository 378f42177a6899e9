"""Loops from the fourth open-world audit (docs/recordable-ops.md, "Training patterns audited (round 4)") that the
guard got wrong, in plain torch (the Lightning and DDP ones are in tests/integrations/test_manual_gan.py and
tests/distributed/test_ddp_zero.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard


def _both_losses(gan, batch):
    fake = gan["G"](batch[1])
    return (F.softplus(-gan["D"](batch[0])).mean() + F.softplus(gan["D"](fake.detach())).mean()
            + F.softplus(-gan["D"](fake)).mean())


def _gan_loop(folder, *, name_it: bool):
    """One guard over a GAN whose two optimizers each step after their own backward (optimizer=None)."""
    torch.manual_seed(0)
    gan = nn.ModuleDict({"G": nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6)),
                         "D": nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))})
    opt_g, opt_d = torch.optim.Adam(gan["G"].parameters(), lr=1e-3), torch.optim.Adam(gan["D"].parameters(), lr=1e-3)
    guard = NanGuard(gan, None, step_fn=_both_losses, folder=folder)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, z = torch.randn(4, 6, generator=g), torch.randn(4, 4, generator=g)
        guard.begin((x, z), step=step)
        fake = gan["G"](z)
        d_loss = F.softplus(-gan["D"](x)).mean() + F.softplus(gan["D"](fake.detach())).mean()
        opt_d.zero_grad()
        d_loss.backward()
        assert guard.grads_ok(optimizer=opt_d if name_it else None) or not name_it
        opt_d.step()
        opt_g.zero_grad()
        F.softplus(-gan["D"](fake)).mean().backward()
        assert guard.grads_ok(optimizer=opt_g if name_it else None) or not name_it
        opt_g.step()
    return guard


def test_one_guard_over_two_optimizers_checks_the_one_about_to_step(tmp_path):
    """At the discriminator's step the generator has no gradient yet (its loss comes next): not a dead gradient.
    Told which optimizer steps, the guard asks only its parameters; without it, every parameter of the model."""
    _gan_loop(tmp_path / "named", name_it=True)
    assert not (tmp_path / "named").exists() or not list((tmp_path / "named").iterdir())
    _gan_loop(tmp_path / "unnamed", name_it=False)
    assert [p.name.split("_")[2:4] for p in (tmp_path / "unnamed").glob("*.pt")] == [["no", "gradient"]]
