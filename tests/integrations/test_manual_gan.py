"""Lightning manual optimization with two optimizers (a GAN: the discriminator steps after its own
manual_backward, then the generator after its own), from the open-world audit, round 4 (docs/recordable-ops.md).

One guard watches both. Its gradient check runs before each optimizer's step, and took every parameter of the
module as trained: at the discriminator's step the generator has no gradient yet (its loss comes next), so the
healthy run wrote a `no_gradient` snapshot at step 0, "not reproduced" by the analysis. The check now asks only the
optimizer about to step for a gradient. A real dead path (a detach inside the generator) still fires, and a NaN
still stops training with a snapshot analyzed where neither Lightning nor the training code can be imported.
"""

from __future__ import annotations

import pytest
import torch
from isolation import analyze_isolated, framework, load_training_code, marker_line

pytestmark = pytest.mark.integrations

TRAINING_CODE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning.pytorch as L


class Gen(nn.Module):
    def __init__(self, cut):
        super().__init__()
        self.a, self.b, self.cut = nn.Linear(4, 16), nn.Linear(16, 6), cut

    def forward(self, z):
        h = torch.relu(self.a(z))
        return self.b(h.detach() if self.cut else h)  # a stray detach: `a` never learns


class GAN(L.LightningModule):
    def __init__(self, cut=False):
        super().__init__()
        self.automatic_optimization = False
        self.G = Gen(cut)
        self.D = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, z = batch
        x = x / x.norm(dim=-1, keepdim=True)  # LINE: gan
        opt_g, opt_d = self.optimizers()
        fake = self.G(z)
        d_loss = F.softplus(-self.D(x)).mean() + F.softplus(self.D(fake.detach())).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.softplus(-self.D(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.seen.append((d_loss.item(), g_loss.item()))

    def configure_optimizers(self):
        return torch.optim.Adam(self.G.parameters(), lr=1e-3), torch.optim.Adam(self.D.parameters(), lr=1e-3)


def loader(bad=None):
    g = torch.Generator().manual_seed(1)
    xs, zs = torch.randn(16, 6, generator=g), torch.randn(16, 4, generator=g)
    if bad is not None:
        xs[bad * 4 + 1] = 0  # an all-zero sample at that step
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, zs), batch_size=4)
'''


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    framework("lightning.pytorch")
    return load_training_code(tmp_path_factory.mktemp("proj"), "ganmod", TRAINING_CODE)


def fit(mod, folder, guarded, cut=False, bad=None):
    import lightning.pytorch as L

    from nanreplay.lightning import NanGuardCallback

    torch.manual_seed(0)
    module = mod.GAN(cut)
    cbs = [NanGuardCallback(folder, on_nonfinite="skip")] if guarded else []
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
    trainer.fit(module, mod.loader(bad))
    return module, (cbs[0].guard if cbs else None), sorted(str(p) for p in folder.glob("*.pt"))


def test_two_manual_optimizers_are_invisible_and_raise_no_false_dead_gradient(mod, tmp_path):
    plain, _, _ = fit(mod, tmp_path / "off", False)
    guarded, guard, written = fit(mod, tmp_path / "on", True)
    assert len(plain.seen) == 4 and plain.seen == guarded.seen
    assert all(torch.equal(p, q) for p, q in zip(plain.state_dict().values(), guarded.state_dict().values(), strict=True))
    assert written == [] and guard is not None


def test_a_dead_generator_layer_still_fires_under_two_optimizers(mod, tmp_path):
    _, _, written = fit(mod, tmp_path / "cut", True, cut=True)
    assert len(written) == 1 and "_no_gradient" in written[0], written
    snap = torch.load(written[0], weights_only=True)
    assert {d["name"] for d in snap["gradient_flow"]["dead"]} == {"G.a.weight", "G.a.bias"}


def test_a_nan_under_two_manual_optimizers_is_localised_without_lightning(mod, tmp_path):
    _, _, written = fit(mod, tmp_path / "bad", True, bad=2)
    assert len(written) == 1 and "_loss_" in written[0], written  # (Lightning counts both optimizers' steps)
    d = analyze_isolated(written, tmp_path / "elsewhere", also_blocked=("ganmod",))[written[0]]
    assert d["verdict"] == "culprit_found" and d["culprit"]["forward_op"] == "aten.div.Tensor"
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING_CODE, "gan")
    assert d["diagnosis"]["fix"]["verified"] is True
