"""Native snapshots: the step program replays like the eager model; what cannot be recorded, loss specs, trust."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanmodels
from nanreplay import NanGuard
from nanreplay.analysis import analyze
from nanreplay.errors import TrustError, UsageError
from nanreplay.formats import loss_spec as specs
from nanreplay.formats import native

# ---------------------------------------------------------------- step program == eager model


def native_snapshot(case: str, folder: Path, **guard_kw) -> Path:
    """Run one step of a fixture case under NanGuard and return the snapshot it wrote."""
    return nanmodels.CASES[case].native_snapshot(folder, **guard_kw)


KEYS = ("op", "phase", "kind", "forward_op", "backward_node", "module", "role")
EXPORT_CASES = [n for n, c in nanmodels.CASES.items()
                if c.expect.get("verdict") != "not_reproduced" and n != "custom_backward"]


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_step_program_gives_the_eager_culprit(case, tmp_path, analyzed):
    eager = analyzed(case, verify=False)
    d = analyze(native_snapshot(case, tmp_path), verify=False).to_json()
    assert "step program" in d["model"]["how"]
    assert {k: d["culprit"][k] for k in KEYS} == {k: eager["culprit"][k] for k in KEYS}
    assert d["culprit"]["source"]["line"] == eager["culprit"]["source"]["line"]
    assert d["anomaly_mode"]["raises"] == eager["anomaly_mode"]["raises"]
    assert [g["name"] for g in d["gradients"]] == [g["name"] for g in eager["gradients"]]
    # module calls recorded with the program match the eager module calls
    assert [a["module"] for a in d["activations"]] == [a["module"] for a in eager["activations"]]
    assert [(r["module"], r["output_shape"]) for r in d["gradient_shapes"]] == \
        [(r["module"], r["output_shape"]) for r in eager["gradient_shapes"]]


def test_custom_autograd_function_is_not_recorded_without_its_backward(tmp_path, analyzed):
    """A program holds a custom Function's forward ops, not its hand-written backward: replaying it would
    silently use autograd's own (correct) derivative and miss the bug. So no program is written."""
    path = native_snapshot("custom_backward", tmp_path)
    d = torch.load(path, weights_only=True)
    assert d["step_program"] is None and "SafeInv" in d["program_error"]
    with pytest.raises(TrustError, match="custom autograd.Function"):
        analyze(path)
    named = analyze(path, model="nanmodels:inv_features", verify=False).to_json()
    eager = analyzed("custom_backward", verify=False)
    assert {k: named["culprit"][k] for k in KEYS} == {k: eager["culprit"][k] for k in KEYS}
    assert named["culprit"]["source"]["line"] == nanmodels.CASES.marker_line("custom_backward")
    assert named["culprit"]["forward_source"]["code"] == "return x.clamp_min(1e-3).reciprocal()"


# ---------------------------------------------------------------- control flow, loss specs, trust


class Branchy(nn.Module):
    """Data-dependent control flow (torch.export cannot trace it; a recorded program is what ran)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            h = h * 2
        return torch.log(F.relu(h)).mean()


def test_data_dependent_control_flow_travels_as_a_program(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "Branchy", Branchy, raising=False)
    torch.manual_seed(0)
    model = Branchy()
    guard = NanGuard(model, folder=tmp_path)
    x = torch.randn(8, 4)
    guard.begin(x)
    assert not guard.loss_ok(model(x))
    d = torch.load(guard.last_snapshot, weights_only=True)
    assert d["step_program"] is not None and d["program_error"] is None
    factory = f"{__name__}:Branchy"  # this test file, under the name pytest imported it as
    assert d["model"]["factory"] == factory
    plain = analyze(guard.last_snapshot, verify=False).to_json()  # no flags, no code
    named = analyze(guard.last_snapshot, model=factory, verify=False).to_json()
    for r in (plain, named):
        assert r["culprit"]["op"] == "aten.log.default" and r["culprit"]["source"]["file"].endswith(Path(__file__).name)
    assert "step program" in plain["model"]["how"] and "--model" in named["model"]["how"]


def test_without_a_program_the_factory_needs_trust(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "Branchy", Branchy, raising=False)
    torch.manual_seed(0)
    model = Branchy()
    guard = NanGuard(model, folder=tmp_path, export=False)
    x = torch.randn(8, 4)
    guard.begin(x)
    assert not guard.loss_ok(model(x))
    factory = f"{__name__}:Branchy"
    with pytest.raises(TrustError, match=rf"{re.escape(factory)}.*--trust.*--model"):
        analyze(guard.last_snapshot)
    trusted = analyze(guard.last_snapshot, trust=True, verify=False).to_json()
    assert trusted["culprit"]["op"] == "aten.log.default" and "--trust" in trusted["model"]["how"]


def test_loss_modules_and_partials_are_recorded_as_data():
    import functools

    spec = specs.loss_spec(nn.CrossEntropyLoss(ignore_index=3, label_smoothing=0.1))
    assert spec == {"kind": "module", "class": "CrossEntropyLoss",
                    "kwargs": {"weight": None, "ignore_index": 3, "reduction": "mean", "label_smoothing": 0.1}}
    fn, _ = specs.loss_from_spec(spec, trust=False)
    assert isinstance(fn, nn.CrossEntropyLoss) and fn.ignore_index == 3 and fn.label_smoothing == 0.1
    spec = specs.loss_spec(functools.partial(F.cross_entropy, ignore_index=-1))
    assert spec == {"kind": "functional", "name": "cross_entropy", "kwargs": {"ignore_index": -1}}
    assert specs.loss_spec(nanmodels.log_loss) == {"kind": "callable", "spec": "nanmodels:log_loss"}
    with pytest.raises(TrustError, match="--trust"):
        specs.loss_from_spec({"kind": "callable", "spec": "os:system"}, trust=False)


def _hostile_native(tmp_path: Path, factory: str) -> Path:
    model = nanmodels.tiny()
    guard = NanGuard(model, folder=tmp_path, export=False, factory=factory)
    guard.begin(torch.randn(2, 4))
    d = guard.to_dict("loss")
    p = tmp_path / "hostile.pt"
    torch.save(d, p)
    return p


def test_hostile_factory_never_runs_without_trust(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    (tmp_path / "evil_payload.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef build():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for factory in ("os:system", "evil_payload:build"):
        p = _hostile_native(tmp_path, factory)
        with pytest.raises(TrustError) as e:
            analyze(p)
        assert factory in str(e.value) and "--trust" in str(e.value)
    assert not marker.exists()


def test_hostile_factory_via_cli_is_one_line(tmp_path):
    from click.testing import CliRunner

    from nanreplay.cli import main

    p = _hostile_native(tmp_path, "os:system")
    res = CliRunner().invoke(main, ["analyze", str(p)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.stderr.strip().count("\n") == 0 and "'os:system'" in res.stderr and "--trust" in res.stderr


def test_newer_format_version_is_refused(tmp_path):
    p = _hostile_native(tmp_path, "x:y")
    d = torch.load(p, weights_only=True)
    d["version"] = native.VERSION + 1
    torch.save(d, p)
    with pytest.raises(UsageError, match="newer than this nanreplay understands"):
        analyze(p)
