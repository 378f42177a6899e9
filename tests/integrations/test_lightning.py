"""nanreplay.lightning.NanGuardCallback in real Lightning runs (CPU, seconds each): the one line a user adds.

Real faults in tiny LightningModules — sqrt at zero in training_step (32-true, bf16-mixed, and in the middle
of an accumulation window), a masked mean over no rows under manual optimization, an fp16 overflow under
16-mixed with its GradScaler — each stops training with a TrainingStopped that names the snapshot, and each
snapshot is analyzed where neither Lightning nor the training code can be imported. A healthy 16-mixed run
whose scaler starts far too high writes nothing and records the losses training_step computed; `skip`
goes on without applying the bad step.
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


class PairNet(L.LightningModule):
    """Distances between embedding pairs: a duplicated pair is sqrt at zero (finite loss, Inf gradient)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
        self.seen = []  # each training_step's loss, as it computed it

    def training_step(self, batch, batch_idx):
        a, b = batch
        d = ((self.enc(a) - self.enc(b)) ** 2).sum(-1).sqrt()  # LINE: sqrt
        loss = d.mean()
        self.log("train_loss", loss)
        return {"loss": loss, "raw": loss.detach()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(float(outputs["raw"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class MaskedRegression(L.LightningModule):
    """Manual optimization; the loss is a mean over the labelled rows: a batch with none is 0/0."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y, mask = batch
        opt = self.optimizers()
        opt.zero_grad()
        err = (self.net(x).squeeze(-1) - y) ** 2
        loss = (err * mask).sum() / mask.sum()  # LINE: masked mean
        self.log("train_loss", loss, prog_bar=True)
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Energy(L.LightningModule):
    """Unnormalised features under fp16 autocast: a squared activation passes 65504."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.fc(x)
        energy = (h * h).mean(-1)  # LINE: fp16
        loss = F.mse_loss(energy.float(), y)
        return {"loss": loss, "raw": loss.detach()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(float(outputs["raw"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def pairs(n=32, duplicate=None):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, 6, generator=g)
    b = a + 0.3 * torch.randn(n, 6, generator=g)
    if duplicate is not None:
        b[duplicate] = a[duplicate]
    return torch.utils.data.TensorDataset(a, b)


def masked(n=32, empty_batch=None, batch_size=4):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.3).float()
    mask[: batch_size] = 1.0
    if empty_batch is not None:
        mask[empty_batch * batch_size:(empty_batch + 1) * batch_size] = 0.0
    return torch.utils.data.TensorDataset(x, y, mask)


def features(n=32, loud_row=None):
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, generator=g)
    if loud_row is not None:
        x[loud_row] = 1e3  # raw sensor counts, never normalised
    return torch.utils.data.TensorDataset(x, y)
'''

BATCH = 4


@pytest.fixture(scope="module")
def L():
    return framework("lightning.pytorch")


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    framework("lightning.pytorch")
    return load_training_code(tmp_path_factory.mktemp("proj"), "lightmod", TRAINING_CODE)


def fit(L, module, dataset, callback, **trainer_args):
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **trainer_args)
    trainer.fit(module, loader)
    return trainer


def fp16_plugin(init_scale=2.0**16):
    """16-mixed on the CPU: Lightning turns precision='16-mixed' into bf16 there, so the plugin is given."""
    from lightning.pytorch.plugins import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


def stopped_run(L, module, dataset, folder, **trainer_args):
    from nanreplay.errors import TrainingStopped
    from nanreplay.lightning import NanGuardCallback

    cb = NanGuardCallback(folder)
    with pytest.raises(TrainingStopped) as info:
        fit(L, module, dataset, cb, **trainer_args)
    path = cb.guard.last_snapshot
    assert path and info.value.snapshot == path
    assert path in str(info.value) and f"nanreplay analyze {path}" in str(info.value)
    return path, cb


@pytest.fixture(scope="module")
def runs(L, mod, tmp_path_factory):
    """Every faulty run, then one isolated analysis of all their snapshots."""
    out = tmp_path_factory.mktemp("snaps")
    torch.manual_seed(0)
    cases = {
        "sqrt": stopped_run(L, mod.PairNet(), mod.pairs(duplicate=13), out / "sqrt"),
        "bf16": stopped_run(L, mod.PairNet(), mod.pairs(duplicate=13), out / "bf16", precision="bf16-mixed"),
        # window 1 holds batches 4..7; the duplicate (row 25) is in batch 6, its micro-batch 2
        "accumulated": stopped_run(L, mod.PairNet(), mod.pairs(duplicate=25), out / "accumulated",
                                   accumulate_grad_batches=4),
        "manual": stopped_run(L, mod.MaskedRegression(), mod.masked(empty_batch=3), out / "manual"),
        "fp16": stopped_run(L, mod.Energy(), mod.features(loud_row=9), out / "fp16", plugins=[fp16_plugin()]),
    }
    paths = {k: p for k, (p, _) in cases.items()}
    analyses = analyze_isolated(list(paths.values()), tmp_path_factory.mktemp("elsewhere"), also_blocked=("lightmod",))
    return {k: (paths[k], analyses[paths[k]], cases[k][1]) for k in cases}


def _culprit_line(d):
    src = d["culprit"]["source"] or {}
    return src.get("file", "").rsplit("/", 1)[-1], src.get("line")


@pytest.mark.parametrize("case", ["sqrt", "bf16", "accumulated"])
def test_sqrt_at_zero_in_training_step(runs, case):
    path, d, cb = runs[case]
    snap = torch.load(path, weights_only=True)
    assert snap["trigger"] == "gradient"
    assert "step program" in d["model"]["how"], d["model"]["how"]
    assert d["verdict"] == "culprit_found"
    assert _culprit_line(d) == ("lightmod.py", marker_line(TRAINING_CODE, "sqrt"))
    assert d["diagnosis"]["cause"] == "sqrt_at_zero"
    # the op ran in training_step, the loss/step code, not inside a submodule: "where it ran" says so (#28)
    assert d["culprit"]["module"] == "" and "in training_step(), the loss/step code" in d["diagnosis"]["explanation"]
    a, b = snap["batch"]["batch"]
    assert bool((a == b).all(-1).any()), "the snapshot holds the batch with the duplicated pair"


def test_bf16_mixed_is_recorded_as_autocast(runs):
    snap = torch.load(runs["bf16"][0], weights_only=True)
    assert snap["autocast"] == {"device_type": "cpu", "dtype": "bfloat16", "enabled": True}
    assert snap["environment"]["dtype"] == "float32"


def test_a_bad_micro_batch_in_the_middle_of_an_accumulation_window(runs):
    path, d, cb = runs["accumulated"]
    snap = torch.load(path, weights_only=True)
    assert (snap["step"], snap["micro_batch"]) == (1, 2), path
    assert "_micro2_" in path


def test_manual_optimization_masked_mean_over_no_rows(runs):
    path, d, cb = runs["manual"]
    snap = torch.load(path, weights_only=True)
    assert snap["trigger"] == "loss" and snap["step"] == 3
    assert float(snap["batch"]["batch"][2].sum()) == 0.0
    assert d["verdict"] == "culprit_found" and d["culprit"]["op"].startswith("aten.div")
    assert _culprit_line(d) == ("lightmod.py", marker_line(TRAINING_CODE, "masked mean"))
    # a count of rows is not a norm, but every division rule's fix (a floor under the denominator) is the right one
    assert d["diagnosis"]["cause"] == "masked_mean_empty"  # (err * mask).sum() / mask.sum() over no rows
    assert d["diagnosis"]["fix"]["verified"] is True


def test_fp16_overflow_under_16_mixed(runs):
    path, d, cb = runs["fp16"]
    snap = torch.load(path, weights_only=True)
    assert snap["trigger"] == "loss" and snap["autocast"]["dtype"] == "float16"
    assert snap["grad_scale"] == 2.0**16
    assert _culprit_line(d) == ("lightmod.py", marker_line(TRAINING_CODE, "fp16"))
    assert d["diagnosis"]["cause"] == "fp16_overflow"
    # verified means finite and plausible against the run's history; whichever it is, the replay says why
    fix = next(f for f in [d["diagnosis"]["fix"], *d["diagnosis"]["candidates"]] if f["kind"] == "bf16_or_grad_scaler")
    assert fix["replay"]["loss"] is not None and fix["verified"] is (fix["replay"]["plausible"] is not False)


def test_the_recorded_loss_is_what_training_step_computed(L, mod, tmp_path):
    """16-mixed with a scaler that starts far too high (its first steps overflow and back off) and two
    micro-batches per step: no snapshot, and each step's recorded loss is the sum of its training_step
    losses, not Lightning's scaled and divided value."""
    from nanreplay.lightning import NanGuardCallback

    torch.manual_seed(0)
    cb = NanGuardCallback(tmp_path)
    module = mod.Energy()
    trainer = fit(L, module, mod.features(), cb, plugins=[fp16_plugin(init_scale=2.0**40)], accumulate_grad_batches=2)
    scaler = trainer.precision_plugin.scaler
    assert scaler.get_scale() < 2.0**40, "the scaler never backed off: the test proves nothing"
    assert not list(tmp_path.iterdir()) and cb.guard.snapshots == []
    rows = [h for h in cb.guard.history if h["loss"] is not None]
    sums = [module.seen[i] + module.seen[i + 1] for i in range(0, len(module.seen), 2)]
    assert len(rows) == len(sums) == 4
    assert [h["loss"] for h in rows] == pytest.approx(sums, rel=1e-4)


def test_skip_goes_on_without_applying_the_bad_step(L, mod, tmp_path):
    from nanreplay.lightning import NanGuardCallback

    torch.manual_seed(0)
    module = mod.PairNet()
    seen = {}

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen[batch_idx] = [p.detach().clone() for p in pl_module.parameters()]

    cb = NanGuardCallback(tmp_path, on_nonfinite="skip")
    loader = torch.utils.data.DataLoader(mod.pairs(duplicate=13), batch_size=BATCH)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch(), cb])
    trainer.fit(module, loader)
    assert trainer.global_step == 8 and len(cb.guard.snapshots) == 1 and "nan_step000003_gradient" in cb.guard.snapshots[0]
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert all(torch.equal(x, y) for x, y in zip(seen[3], seen[4], strict=True)), "the bad step changed the weights"
    assert not all(torch.equal(x, y) for x, y in zip(seen[2], seen[3], strict=True))


def test_options_are_checked(tmp_path):
    framework("lightning.pytorch")
    from nanreplay.errors import GuardError
    from nanreplay.lightning import NanGuardCallback

    with pytest.raises(GuardError, match="on_nonfinite"):
        NanGuardCallback(tmp_path, on_nonfinite="ignore")
    with pytest.raises(GuardError, match="step_fn"):
        NanGuardCallback(tmp_path, step_fn=lambda m, b: 0)


@pytest.mark.parametrize(("case", "made"), [("sqrt", "return torch.optim.SGD(self.parameters(), lr=0.05)"),
                                            ("manual", "return torch.optim.Adam(self.parameters(), lr=1e-3)"),
                                            ("fp16", "return torch.optim.SGD(self.parameters(), lr=1e-3)")])
def test_the_optimizer_made_in_configure_optimizers_is_recorded_where_it_was_made(runs, case, made):
    """The LightningModule's file is the model class's (Lightning's own frames are skipped): its configure_optimizers
    line is the site, told apart from the other modules' by the literal rate (two SGDs, lr=0.05 and lr=1e-3)."""
    snap = torch.load(runs[case][0], weights_only=True)
    (site,) = [s for s in snap["sites"] if s["what"] == "optimizer"]
    line = next(i for i, ln in enumerate(TRAINING_CODE.splitlines(), 1) if ln.strip() == made)
    assert site["file"].endswith("lightmod.py") and site["line"] == line and site["text"].strip() == made, site
    assert not [s for s in snap["sites"] if s["what"] == "autocast"]  # 16-mixed is Lightning's plugin, not a line
