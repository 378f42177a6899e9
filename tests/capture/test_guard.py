"""NanGuard in real training loops (trained in a subprocess, analyzed elsewhere) and its reliability."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanmodels
from nanreplay import NanGuard
from nanreplay.analysis import analyze
from nanreplay.formats import native

ROOT = Path(__file__).resolve().parents[2]

TRAINING_CODE = '''
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from nanreplay import NanGuard


class RateModel(nn.Module):
    """Poisson regression with a ReLU rate: the rate dies and log(0) = -inf."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.rate = nn.Linear(8, 1)

    def forward(self, x, counts):
        lam = F.relu(self.rate(torch.tanh(self.body(x)))).squeeze(-1)
        return (lam - counts * torch.log(lam)).mean()  # LINE: loss


class PairModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.Tanh())

    def forward(self, a, b):
        d = ((self.enc(a) - self.enc(b)) ** 2).sum(-1).sqrt()  # LINE: gradient
        return F.dropout(d, 0.3).mean()


class AmpModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))  # LINE: autocast


def batches(kind, step):
    g = torch.Generator().manual_seed(step)
    if kind == "loss":
        return (torch.randn(16, 4, generator=g), torch.poisson(torch.full((16,), 2.0), generator=g)), None
    if kind == "gradient":
        a = torch.randn(8, 6, generator=g)
        b = a + 0.5 * torch.randn(8, 6, generator=g)
        if step == 3:
            b[4] = a[4]  # a duplicated pair arrives at step 3
        return (a, b), None
    x = torch.randn(8, 16, generator=g) * (1.0 if step < 2 else 3000.0)  # activations explode at step 2
    return x, torch.zeros(8, 1)


def main(kind, folder):
    torch.manual_seed(0)
    model = {"loss": RateModel, "gradient": PairModel, "autocast": AmpModel}[kind]()
    if kind == "autocast":
        with torch.no_grad():
            model.fc1.weight.mul_(20)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = F.mse_loss if kind == "autocast" else None
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder)
    for step in range(6):
        inputs, target = batches(kind, step)
        guard.begin(inputs, target, step=step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=(kind == "autocast")):
            out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            loss = out if loss_fn is None else loss_fn(out.float(), target)
        if not guard.loss_ok(loss):
            break
        loss.backward()
        if not guard.grads_ok():
            break
        opt.step()
    print(guard.last_snapshot)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''

ANALYZE_ELSEWHERE = '''
import json, sys
try:
    import trainmod
    raise SystemExit("the training code must not be importable here")
except ImportError:
    pass
from nanreplay.analysis import analyze
print(json.dumps(analyze(sys.argv[1]).to_json()))
'''


def _line(marker: str) -> int:
    return next(i for i, ln in enumerate(TRAINING_CODE.splitlines(), 1) if ln.endswith(f"# LINE: {marker}"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Train each model in its own process until NanGuard fires; analyze elsewhere, also in a fresh process."""
    root = tmp_path_factory.mktemp("capture")
    proj, elsewhere = root / "proj", root / "elsewhere"
    proj.mkdir()
    elsewhere.mkdir()
    (proj / "trainmod.py").write_text(TRAINING_CODE)
    (elsewhere / "analyze_it.py").write_text(ANALYZE_ELSEWHERE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = {}
    for kind in ("loss", "gradient", "autocast"):
        res = subprocess.run([sys.executable, "trainmod.py", kind, str(root / "snaps" / kind)], cwd=proj,
                             capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stderr
        snap = res.stdout.strip().splitlines()[-1]
        assert snap.endswith(".pt"), res.stdout
        res = subprocess.run([sys.executable, str(elsewhere / "analyze_it.py"), snap], cwd=elsewhere,
                             capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stderr
        out[kind] = (Path(snap), json.loads(res.stdout))
    return out


def test_loss_trigger_analyzed_without_training_code(trained):
    path, d = trained["loss"]
    assert d["snapshot_info"]["trigger"] == "loss" and d["snapshot_info"]["format"] == "native"
    assert "step program" in d["model"]["how"]
    c = d["culprit"]
    assert (c["op"], c["phase"], c["kind"], c["module"]) == ("aten.log.default", "forward", "inf", "")
    assert c["source"]["file"].endswith("trainmod.py") and c["source"]["line"] == _line("loss")
    assert "torch.log(lam)" in c["source"]["code"]
    # counts * log(lam) with count 0 and rate 0 is also 0 * log(0): either reading is right; the fix must verify
    assert d["diagnosis"]["cause"] in ("log_of_zero", "zero_times_log_zero")
    # where a count is positive at lam = 0 the true loss is infinite: an eps inside log sets the loss (it moves when
    # eps moves), so it is honestly not verified (issue 28). The rate is a ReLU's: the fix is softplus where it is made
    fix = d["diagnosis"]["fix"]
    assert fix["code"] and "lam = F.softplus(self.rate(" in fix["code"]
    assert fix["verified"] is True or (fix["replay"]["plausible"] is False and fix["replay"]["why"]), fix["replay"]


def test_gradient_trigger_catches_the_inf_trap(trained):
    path, d = trained["gradient"]
    info = d["snapshot_info"]
    assert info["trigger"] == "gradient" and info["step"] == 3
    assert [h["step"] for h in info["history"]] == [0, 1, 2, 3]
    assert isinstance(info["history"][-1]["loss"], float)  # the loss was finite: a loss check alone misses it
    c = d["culprit"]
    assert (c["backward_node"], c["forward_op"], c["module"]) == ("SqrtBackward0", "aten.sqrt.default", "")
    assert c["source"]["line"] == _line("gradient")
    # dropout replayed with the recorded RNG state: the replayed loss is the training loss, exactly
    assert d["loss"] == pytest.approx(info["history"][-1]["loss"], rel=0, abs=0)


def test_autocast_step_replays_under_autocast(trained):
    path, d = trained["autocast"]
    assert d["model"]["autocast"] == {"device_type": "cpu", "dtype": "torch.float16"}
    c = d["culprit"]
    assert c["kind"] == "inf" and c["module"] == "fc1" and c["source"]["line"] == _line("autocast")
    assert any(i["dtype"] == "float16" for i in c["inputs"])
    assert d["diagnosis"]["cause"] == "fp16_overflow"
    # the batch is 3000x too large: normalising it is the advice; bf16 autocast was tried too, and keeps the step
    # finite, but is verified only if also plausible against the history
    assert d["diagnosis"]["fix"]["kind"] == "normalize_input" and "`x`" in d["diagnosis"]["explanation"]
    fix = next(f for f in d["diagnosis"]["candidates"] if f["kind"] == "bf16_or_grad_scaler")
    assert isinstance(fix["replay"]["loss"], float) and fix["verified"] is (fix["replay"]["plausible"] is not False)
    assert any(r["dtype"] == "float32 (autocast off)" and r["loss_finite"] for r in d["precision"])


def test_snapshot_is_plain_data(trained):
    path, _ = trained["gradient"]
    d = torch.load(path, weights_only=True)
    assert d["format"] == native.FORMAT and d["version"] == native.VERSION
    assert isinstance(d["step_program"], str) and d["program_error"] is None
    assert d["optimizer"]["class"] == "SGD" and d["optimizer"]["state_dict"]["param_groups"][0]["lr"] == 0.01
    assert d["rng"]["cpu"].dtype == torch.uint8 and d["model_training"] is True
    assert all(t.device.type == "cpu" for t in d["state"].values())
    assert set(d["parameters"]) <= set(d["state"])


# ---------------------------------------------------------------- reliability


def _bad_step(guard: NanGuard, model: nn.Module) -> bool:
    x = torch.randn(3, 4)
    guard.begin(x)
    return guard.loss_ok(model(x).sum() * float("nan"))


def test_write_failure_never_crashes_training(tmp_path, monkeypatch):
    model = nanmodels.tiny()
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    guard = NanGuard(model, folder=blocker / "snaps", export=False)  # the folder cannot be created
    with pytest.warns(RuntimeWarning, match="could not write a snapshot"):
        assert _bad_step(guard, model) is False
    assert guard.last_snapshot is None and guard.last_error

    def disk_full(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", disk_full)
    guard = NanGuard(model, folder=tmp_path / "snaps", export=False)
    with pytest.warns(RuntimeWarning, match="No space left"):
        assert _bad_step(guard, model) is False
    assert guard.last_snapshot is None
    assert list((tmp_path / "snaps").iterdir()) == []  # no half-written file, no temp debris


def test_names_never_collide_and_the_cap_holds(tmp_path):
    model = nanmodels.tiny()
    guard = NanGuard(model, folder=tmp_path, export=False, max_snapshots=2)
    with pytest.warns(RuntimeWarning, match="not writing more than 2 snapshots"):
        for _ in range(5):
            guard.begin(torch.randn(3, 4), step=7)  # the same step, within the same second
            guard.loss_ok(model(torch.randn(3, 4)).sum() * float("inf"))
    files = sorted(tmp_path.glob("*.pt"))
    assert len(files) == 2 and len(set(files)) == 2
    assert all(f.name.startswith("nan_step000007_loss_") for f in files)
    assert not list(tmp_path.glob(".*"))


def test_gradient_spike_trigger(tmp_path):
    torch.manual_seed(0)
    model = nanmodels.tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=tmp_path, spike_factor=100.0, export=False)
    for step in range(15):
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        if step == 14:
            x = x * 1e5
        guard.begin(x, y)
        assert guard.step(F.cross_entropy(model(x), y))  # finite throughout: the loop goes on
    (snap,) = tmp_path.glob("*.pt")
    assert "grad_spike" in snap.name and torch.load(snap, weights_only=True)["step"] == 14


def test_grad_scaler_back_off_is_never_a_failure_but_an_overflow_at_scale_one_is(tmp_path):
    class FakeScaler:
        scale = 65536.0

        def get_scale(self):
            return self.scale

    model = nanmodels.tiny()
    scaler = FakeScaler()
    guard = NanGuard(model, folder=tmp_path, export=False, scaler=scaler)
    results = []
    for _ in range(20):  # the routine back-off: however many overflows, at a scale > 1 none is a failure
        guard.begin(torch.randn(2, 4))
        results.append(guard.grads_ok(float("inf")))
    assert all(results) and not list(tmp_path.glob("*.pt"))
    assert all(h.get("overflow") for h in guard.history)
    scaler.scale = 1.0  # the scale cannot explain an overflow any more: the gradient itself is non-finite
    guard.begin(torch.randn(2, 4))
    assert guard.grads_ok(float("inf")) is False
    d = torch.load(guard.last_snapshot, weights_only=True)
    assert d["trigger"] == "gradient" and d["grad_scale"] == 1.0


def test_importing_the_guard_stays_light():
    code = ("import sys; from nanreplay import NanGuard; "
            "heavy = [m for m in ('pandas', 'jinja2', 'click') if m in sys.modules]; print(heavy)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_guard_without_begin_says_how_to_fix(tmp_path):
    model = nanmodels.tiny()
    guard = NanGuard(model, folder=tmp_path, export=False)
    with pytest.warns(RuntimeWarning, match=r"call guard.begin\(inputs, target\)"):
        assert guard.loss_ok(model(torch.randn(2, 4)).sum() * float("nan")) is False


def test_readme_loop_is_the_documented_one():
    readme = (ROOT / "README.md").read_text()
    loop = textwrap.dedent(readme.split("<!-- guard-loop -->")[1].split("```python\n")[1].split("```")[0])
    assert "guard.loss_ok(loss)" in loop and "guard.grads_ok()" in loop and "guard.begin(" in loop
    compile(loop, "README", "exec")


def test_rank_and_world_size_come_from_torch_distributed(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not built in")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = nanmodels.tiny()
        guard = NanGuard(model, folder=tmp_path / "snaps", loss_fn=F.cross_entropy, export=False)
        x, y = torch.randn(2, 4), torch.tensor([0, 1])
        guard.begin(x, y)
        assert not guard.loss_ok(F.cross_entropy(model(x), y) * float("nan"))
    finally:
        dist.destroy_process_group()
    d = torch.load(guard.last_snapshot, weights_only=True)
    assert (d["rank"], d["world_size"]) == (0, 1) and "_rank0_" in Path(guard.last_snapshot).name
    info = analyze(guard.last_snapshot, model="nanmodels:tiny", verify=False).to_json()["snapshot_info"]
    assert (info["rank"], info["world_size"], info["trigger"]) == (0, 1, "loss")


def test_a_capped_spike_is_said_once_on_an_unconfigured_terminal(tmp_path):
    """The spike cap's message printed twice (logging's last-resort handler and the warning): once now; under
    -W error, where the warning cannot be issued, the log says it."""
    import subprocess
    import sys

    code = textwrap.dedent(f'''
        import torch, torch.nn as nn, torch.nn.functional as F
        from nanreplay import NanGuard
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder={str(tmp_path)!r}, spike_factor=5,
                         max_spike_snapshots=1)
        for step in range(12):
            x, y = torch.randn(8, 4) * (1 if step < 5 else 10.0 ** (step - 3)), torch.zeros(8, 1)
            guard.begin(x, y, step=step)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            guard.grads_ok()
            opt.step()
    ''')
    for flags in ([], ["-W", "error"]):
        res = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert res.returncode == 0, res.stderr
        assert res.stderr.count("not writing more than 1 spike snapshots") == 1, res.stderr
