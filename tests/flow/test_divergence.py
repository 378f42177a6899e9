"""A gradient that dies while training diverges (docs/flow.md, "During a divergence"): the cause is the rate, not the
activation. The LR = 4.0 tanh loop (divtrain.py) first writes a `gradient_died` snapshot; analyzed where its code
cannot be imported, it names the saturated tanh as the mechanism and gives the rate edit on the constant's line.
The edit, applied to a copy of the loop, trains: no death, no snapshot, the loss going down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.isolation import ROOT, analyze_isolated, apply_edits

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def _train(proj: Path, folder: Path) -> dict:
    res = subprocess.run([sys.executable, "divtrain.py", str(folder)], cwd=proj, capture_output=True, text=True,
                         timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("divergence")
    proj = root / "proj"
    proj.mkdir()
    (proj / "divtrain.py").write_text((HERE / "divtrain.py").read_text())
    out = _train(proj, root / "snaps")
    first = sorted(out["snapshots"], key=lambda p: Path(p).name)[0]  # nan_stepNNNNNN_...: the step decides
    return root, out, first, analyze_isolated([first], root / "elsewhere", also_blocked=("divtrain",))[first]


def test_the_first_snapshot_of_a_diverging_tanh_loop_is_its_dead_gradient(run):
    _root, out, first, d = run
    assert "gradient_died" in Path(first).name and out["died"] and first in out["flow"]
    assert d["verdict"] == "gradient_zero" and d["snapshot_info"]["trigger"] == "gradient_died"


def test_a_gradient_that_dies_during_a_divergence_is_blamed_on_the_rate_with_the_saturation_as_mechanism(run):
    d = run[3]
    diag = d["diagnosis"]
    assert diag["cause"] == "training_diverged"
    assert diag["mechanism"]["cause"] == "gradient_zero" and diag["mechanism"]["kind"] == "saturated"
    assert diag["mechanism"]["fix"]["kind"] == "logits"  # what it said before: kept, as the mechanism's
    row = next(r for r in d["gradient_flow"]["per_parameter"] if r["verdict"] == "gradient_zero")
    tanh = next(i for i, ln in enumerate((HERE / "divtrain.py").read_text().splitlines(), 1) if ln.endswith("# TANH"))
    assert row["op"] == "aten.tanh.default" and (Path(row["source"]["file"]).name, row["source"]["line"]) == \
        ("divtrain.py", tanh)
    assert set(d["gradient_flow"]["parameters"]) == {"fc1.weight", "fc1.bias"}
    div = diag["divergence"]
    assert div["onset_step"] < d["snapshot_info"]["step"] and div["loss"][1]["loss"] > 10 * div["loss"][0]["loss"]
    assert d["gradient_flow"]["divergence"] == div and "aten.tanh.default" in diag["explanation"]
    fix = diag["fix"]
    assert fix["kind"] == "lower_lr_clip_grads" and fix["verified"] is None
    (edit,) = fix["edits"]
    assert Path(edit["file"]).name == "divtrain.py" and edit["before"] == "LR = 4.0"
    assert edit["after"].startswith("LR = ") and 0 < float(edit["after"].split("=")[1]) < 4.0 / 10


def test_the_rate_edit_applied_trains_without_death_and_the_loss_goes_down(run, tmp_path):
    root, _out, _first, d = run
    proj = tmp_path / "fixed"
    proj.mkdir()
    (proj / "divtrain.py").write_text((root / "proj" / "divtrain.py").read_text())
    apply_edits(proj / "divtrain.py", d["diagnosis"]["fix"]["edits"])
    out = _train(proj, tmp_path / "snaps")
    assert out["snapshots"] == [] and not out["died"] and len(out["losses"]) == 30
    first, last = out["losses"][0], out["losses"][-5:]
    assert max(last) < first / 4, out["losses"]  # the loss climbed 1e20-fold at LR = 4.0


# ---------------------------------------------------------------- the rule itself, on histories (no training)


def _info(losses, norms, step=None, opt="SGD", lr=0.7):
    rows = [{"step": i, "loss": v, "grad_norm": g, "lr": lr} for i, (v, g) in enumerate(zip(losses, norms, strict=True))]
    return {"step": len(rows) - 1 if step is None else step, "history": rows, "optimizer": {"class": opt, "lr": lr}}


def _zero(kind: str, verdict: str = "gradient_zero") -> dict:
    row = {"name": "fc1.weight", "verdict": verdict, "kind": kind}
    return {"cause": verdict, "title": f"{verdict}: x", "explanation": "the flow ends here.",
            "fix": {"kind": "logits"}, "gradient_flow": {"verdict": verdict, "parameters": ["fc1.weight"],
                                                         "per_parameter": [row]}}


def test_a_spike_after_healthy_steps_keeps_its_own_diagnosis_its_own_step_is_not_evidence():
    from nanreplay.diagnose.flow_divergence import reframe_spike

    diag = {"cause": "grad_spike", "explanation": "a spike.", "fix": {"kind": "lower_lr_clip_grads"}, "spike": {}}
    flat = _info([1.0, 1.1, 0.9, 1.0, 1.05, 5e4], [1.0, 1.2, 0.9, 1.1, 1.0, 3e3])  # the last row is the spike's own
    assert reframe_spike(diag, flat) is diag


def test_a_spike_after_a_climbing_loss_is_the_divergence_with_the_sgd_rate_bound():
    from nanreplay.diagnose.flow_divergence import reframe_spike

    diag = {"cause": "grad_spike", "explanation": "a spike.", "fix": {"kind": "lower_lr_clip_grads"}, "spike": {}}
    info = _info([3.8, 4.6, 9.0, 40.0, 300.0, 2e3, 1e9], [2.9, 8.0, 20.0, 60.0, 200.0, 700.0, 1e6])
    out = reframe_spike(diag, info)
    assert out["cause"] == "training_diverged" and out["mechanism"]["kind"] == "spike" and "spike" in out
    # the loss first doubles at step 2, where the norm grew 2.5x in one step: SGD is stable below 2 * 0.7 / 3.5
    assert out["divergence"]["onset_step"] == 2 and 0 < out["fix"]["settings"]["lr"] < 2 * 0.7 / 3.5


@pytest.mark.parametrize("kind, verdict", [("detach", "gradient_cut"), ("frozen", "gradient_cut"),
                                           ("softmax_single", "gradient_zero"), ("discrete", "gradient_zero")])
def test_a_cut_or_a_zero_no_value_changes_keeps_its_diagnosis_in_a_diverging_run(kind, verdict):
    from nanreplay.diagnose.flow_divergence import reframe

    info = _info([3.8, 40.0, 400.0, 4e3, 4e4], [2.9, 30.0, 300.0, 3e3, 3e4])
    diag = _zero(kind, verdict)
    assert reframe(diag, info) is diag
    saturated = reframe(_zero("saturated"), info)  # the same history: a zero the values make is the divergence's
    assert saturated["cause"] == "training_diverged" and saturated["gradient_flow"]["divergence"]["onset_step"] == 1


def test_a_crafted_history_leaves_the_flow_diagnosis_as_it_was():
    from nanreplay.diagnose.flow_divergence import reframe

    diag = _zero("saturated")
    info = {"step": "x", "history": [{"step": "a", "loss": "NaN"}, {"loss": [1]}, None, {"step": 2, "loss": 1e30}]}
    assert reframe(diag, info) is diag
