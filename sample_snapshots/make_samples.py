"""Regenerate the sample snapshots: `python sample_snapshots/make_samples.py` (from the repository root).

Each sample is a real, short training loop guarded by nanreplay.NanGuard: a few
healthy steps, then the batch (or the state) that breaks it, as in the seed
document's catalogue. The guard writes a native snapshot with the model and
loss exported, so `nanreplay analyze sample_snapshots/<name>.pt` needs no flags
and no training code. Everything is seeded: the same batches, weights and
culprits every time (only the snapshot's creation time changes).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from nanreplay import NanGuard  # noqa: E402
from nanreplay.replay.subject import call_model  # noqa: E402


def _models_as_in_the_repository():
    """sample_snapshots.models, its code compiled under its path in the repository ("sample_snapshots/models.py")
    rather than this machine's absolute path: the snapshots record that path, and `nanreplay analyze` shows it —
    the samples show the path a user of any checkout recognises, not the folder of the machine that made them."""
    import os
    import types

    import sample_snapshots

    os.chdir(HERE.parent)  # the recorded context lines are read from there (linecache, by that relative path)
    name, rel = "sample_snapshots.models", "sample_snapshots/models.py"
    module = types.ModuleType(name)
    module.__file__, module.__package__ = rel, "sample_snapshots"
    sys.modules[name] = sample_snapshots.models = module
    exec(compile((HERE / "models.py").read_text(), rel, "exec"), module.__dict__)
    return module


models = _models_as_in_the_repository()

SAMPLES = {}


def sample(name: str, factory: str, loss_fn=None, lr: float = 0.05):
    def deco(batches):
        SAMPLES[name] = (factory, loss_fn, lr, batches)
        return batches
    return deco


@sample("sqrt_zero", "triplet")
def _(step, model):
    a = torch.randn(8, 16)
    p = a + 0.1 * torch.randn(8, 16)
    if step == 3:
        p[5] = a[5]  # the data loader yields a duplicated pair: distance exactly 0
    return (a, p), None


@sample("log_zero", "poisson", lr=0.5)
def _(step, model):
    x = torch.randn(16, 8) * (0.1 if step < 3 else 30.0)  # a batch of outliers drives the ReLU rate to 0
    return (x, torch.poisson(torch.full((16,), 3.0))), None


@sample("sqrt_negative", "std_scaler", F.mse_loss)
def _(step, model):
    return torch.randn(16, 8) * (0.1 if step < 3 else 10.0), torch.randn(16)


@sample("zero_norm", "retriever", F.cross_entropy)
def _(step, model):
    q = torch.randn(8, 12)
    if step == 3:
        q[3] = 0.0  # an empty query reaches the model
    return q, torch.randint(0, 10, (8,))


@sample("zero_log_zero", "entropy_gate")
def _(step, model):
    return torch.randn(16, 10) * (0.1 if step < 3 else 10.0), None  # larger inputs switch gates fully off


@sample("log_softmax", "overconfident", F.nll_loss)
def _(step, model):
    x = torch.randn(16, 20)
    if step == 3:
        with torch.no_grad():
            model.net[2].weight.mul_(400)  # what an aggressive learning rate does to the logits
    with torch.no_grad():
        y = model(x).argmax(-1)
    return x, y


@sample("fp16_overflow", "half_mlp", F.mse_loss, lr=1e-3)
def _(step, model):
    if step == 3:
        with torch.no_grad():
            model.fc2.weight.mul_(2000)  # weights that grew during fp16 training
    return (torch.randn(8, 32) * (1 if step < 3 else 80)).half(), torch.zeros(8).half()


def train(name: str, folder: Path) -> Path:
    factory, loss_fn, lr, batches = SAMPLES[name]
    torch.manual_seed(0)
    model = getattr(models, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder, max_snapshots=1)
    for step in range(6):
        inputs, target = batches(step, model)
        guard.begin(inputs, target, step=step)
        opt.zero_grad()
        out = call_model(model, inputs)
        loss = out if loss_fn is None else loss_fn(out, target)
        if not guard.loss_ok(loss):
            break
        loss.backward()
        if not guard.grads_ok():
            break
        opt.step()
    if guard.last_snapshot is None:
        raise SystemExit(f"{name}: the loop never went non-finite ({guard.last_error or 'no error'})")
    if name == "sqrt_zero":  # the same step in the seed's own format, for `--model` analysis
        torch.save({"x": inputs, "y": target, "state": model.state_dict()}, HERE / "nan_snapshot_step_3.pt")
    return Path(guard.last_snapshot)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in SAMPLES:
            written = train(name, Path(tmp) / name)
            shutil.move(written, HERE / f"{name}.pt")
            print(f"nanreplay analyze sample_snapshots/{name}.pt   # {written.name}")


if __name__ == "__main__":
    main()
