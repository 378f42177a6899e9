"""nanreplay.accelerate.guard_for in the loop docs/integrations.md documents, run as written there (CPU, seconds each).

sqrt at zero in a bad micro-batch in the middle of an accumulation window, and under bf16 mixed precision:
the snapshot is the micro-batch that broke, numbered by the accelerator's accumulation boundary, recorded
with the accelerator's autocast, and analyzed where neither accelerate nor the training code can be imported.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from isolation import ROOT, analyze_isolated, framework, load_training_code, marker_line

pytestmark = pytest.mark.integrations

TRAINING_CODE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator

from nanreplay.accelerate import guard_for


class PairNet(nn.Module):
    """The distance between the two halves of each row, embedded: a duplicated pair is sqrt at zero."""

    def __init__(self):
        super().__init__()
        # no bias in the last layer: it would cancel in enc(a) - enc(b), its gradient exactly zero on every step
        # (the guard would warn once that the loss does not depend on it: inert, docs/flow.md)
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4, bias=False))

    def forward(self, x):
        a, b = x[:, 0].contiguous(), x[:, 1].contiguous()
        return ((self.enc(a) - self.enc(b)) ** 2).sum(-1).sqrt()  # LINE: sqrt


def pairs(n=32, duplicate=None):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, 6, generator=g)
    b = a + 0.3 * torch.randn(n, 6, generator=g)
    if duplicate is not None:
        b[duplicate] = a[duplicate]
    return torch.utils.data.TensorDataset(torch.stack([a, b], dim=1), torch.full((n,), 0.5))


def train(folder, dataset, accumulate=1, mixed_precision="no", lr=0.05):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate, mixed_precision=mixed_precision)
    torch.manual_seed(0)
    model = PairNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    loss_fn = F.mse_loss
{readme_loop}
    return guard
'''


def readme_loop() -> str:
    """docs/integrations.md's Accelerate loop, exactly (writing to the test's folder)."""
    doc = (ROOT / "docs" / "integrations.md").read_text()
    loop = doc.split("<!-- accelerate-loop -->")[1].split("```python\n")[1].split("```")[0]
    assert 'folder="nan_snapshots"' in loop and "guard.begin(x, y)" in loop
    loop = loop.replace("from nanreplay.accelerate import guard_for\n", "").replace('folder="nan_snapshots"',
                                                                                    "folder=folder")
    return textwrap.indent(loop.strip("\n"), "    ")


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    framework("accelerate")
    code = TRAINING_CODE.replace("{readme_loop}", readme_loop())
    return load_training_code(tmp_path_factory.mktemp("proj"), "accmod", code)


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    yield
    _reset()


@pytest.fixture(scope="module")
def runs(mod, tmp_path_factory):
    out = tmp_path_factory.mktemp("snaps")
    # window 1 holds batches 4..7; the duplicate (row 25) is in batch 6, its micro-batch 2
    guards = {"accumulated": mod.train(out / "accumulated", mod.pairs(duplicate=25), accumulate=4)}
    _reset()
    guards["bf16"] = mod.train(out / "bf16", mod.pairs(duplicate=13), mixed_precision="bf16")
    _reset()
    paths = {k: g.last_snapshot for k, g in guards.items()}
    assert all(paths.values()), paths
    analyses = analyze_isolated(list(paths.values()), tmp_path_factory.mktemp("elsewhere"), also_blocked=("accmod",))
    return {k: (p, analyses[p], guards[k]) for k, p in paths.items()}


@pytest.mark.parametrize("case", ["accumulated", "bf16"])
def test_sqrt_at_zero_analyzed_without_accelerate_or_the_training_code(runs, case):
    path, d, guard = runs[case]
    assert "step program" in d["model"]["how"], d["model"]["how"]
    assert d["verdict"] == "culprit_found" and d["diagnosis"]["cause"] == "sqrt_at_zero"
    src = d["culprit"]["source"]
    assert (src["file"].rsplit("/", 1)[-1], src["line"]) == ("accmod.py", marker_line(TRAINING_CODE, "sqrt"))


def test_the_accumulation_boundary_numbers_steps_and_micro_batches(runs):
    path, d, guard = runs["accumulated"]
    snap = torch.load(path, weights_only=True)
    assert (snap["trigger"], snap["step"], snap["micro_batch"]) == ("gradient", 1, 2), path
    a, b = snap["batch"]["inputs"].unbind(1)
    assert bool((a == b).all(-1).any())


def test_bf16_comes_from_the_accelerator(runs):
    path, d, guard = runs["bf16"]
    snap = torch.load(path, weights_only=True)
    assert (snap["step"], snap["micro_batch"]) == (3, None)
    assert snap["autocast"] == {"device_type": "cpu", "dtype": "bfloat16", "enabled": True}
    assert d["precision"], "an autocast snapshot gets the precision probe"


def test_a_healthy_run_writes_nothing_and_counts_optimizer_steps(mod, tmp_path):
    guard = mod.train(tmp_path, mod.pairs(), accumulate=2)
    assert guard.snapshots == [] and not any(tmp_path.iterdir())
    assert [h["step"] for h in guard.history] == [0, 1, 2, 3]
    assert all(h["loss"] is not None and h["grad_norm"] is not None for h in guard.history)


def test_the_update_is_watched_inside_the_accelerated_optimizer(mod, tmp_path):
    """accelerate's optimizer wrapper subclasses torch.optim.Optimizer: the guard must hook the one inside,
    or weights broken by optimizer.step() are only seen a step later, as a NaN loss."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        guard = mod.train(tmp_path, mod.pairs(), lr=float("inf"))  # a warmup that divided by zero steps
    assert not [w for w in seen if "cannot watch" in str(w.message)]
    assert len(guard.snapshots) == 1 and "_update_" in guard.snapshots[0], guard.snapshots
    d = torch.load(guard.snapshots[0], weights_only=True)
    assert d["trigger"] == "update" and d["step"] == 0


def test_fp16_on_the_cpu_is_float32_so_no_scaler_and_no_autocast(tmp_path):
    framework("accelerate")
    from accelerate import Accelerator

    from nanreplay.accelerate import guard_for

    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    guard = guard_for(accelerator, model, folder=tmp_path)
    assert guard.scaler is None and guard._autocast is None and guard.model is model
