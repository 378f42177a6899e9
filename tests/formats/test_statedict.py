"""Plain state-dict snapshots and their common variants load the same way."""

from __future__ import annotations

import pytest
import torch

import nanmodels
from nanreplay import formats
from nanreplay.analysis import analyze


@pytest.mark.parametrize("layout", [
    lambda x, y, s: {"x": x, "y": y, "state": s},
    lambda x, y, s: {"inputs": x, "targets": y, "model_state_dict": s},
    lambda x, y, s: {"batch": (x, y), "state_dict": s},
    lambda x, y, s: {"batch": {"input": x, "labels": y}, "model_state": s, "step": 12},
    lambda x, y, s: {"x": x, "y": y, "state": {f"module.{k}": v for k, v in s.items()}},  # DDP prefix
])
def test_variants_give_the_same_culprit(tmp_path, layout):
    p = tmp_path / "snap.pt"
    torch.save(layout(*nanmodels.classifier_step()), p)
    d = analyze(p, model="nanmodels:classifier", loss="nll_loss", verify=False).to_json()
    assert d["verdict"] == "culprit_found"
    assert (d["culprit"]["backward_node"], d["culprit"]["forward_op"]) == ("LogBackward0", "aten.log.default")


def test_step_from_file_name(tmp_path):
    x, y, s = nanmodels.classifier_step()
    p = tmp_path / "nan_snapshot_step_12.pt"
    torch.save({"x": x, "y": y, "state": s}, p)
    snap = formats.load(p)
    assert snap.step == 12 and snap.format == "state_dict" and snap.keys == {"inputs": "x", "target": "y", "state": "state"}


def test_fp16_state_replays_in_fp16(tmp_path):
    """A factory that builds fp32 must not silently widen an fp16 snapshot (that would hide the overflow)."""
    c = nanmodels.CASES["fp16"]
    p = tmp_path / "half.pt"
    torch.save({**c.batch(), "state": nanmodels.half_mlp().state_dict()}, p)
    d = analyze(p, model="nanmodels:half_mlp_fp32", verify=False).to_json()
    assert d["culprit"]["inputs"][0]["dtype"] == "float16"
    assert d["model"]["dtypes"] == ["float16"]
