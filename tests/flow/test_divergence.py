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
