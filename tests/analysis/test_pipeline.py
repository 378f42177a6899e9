"""The pipeline checks the snapshot's leaves before replay: non-finite inputs or weights are the verdict, not a culprit."""

from __future__ import annotations

import torch

import nanmodels
from nanreplay.analysis import analyze


def test_nonfinite_input_is_reported_before_replay(tmp_path):
    x, y, s = nanmodels.classifier_step()
    x = x.clone()
    x[2, 1] = float("nan")
    x[5, 0] = float("inf")
    p = tmp_path / "bad_input.pt"
    torch.save({"x": x, "y": y, "state": s}, p)
    d = analyze(p, model="nanmodels:classifier", loss="nll_loss").to_json()
    assert d["verdict"] == "nonfinite_input" and d["culprit"] is None
    (leaf,) = d["nonfinite_leaves"]
    assert leaf == {**leaf, "name": "x", "role": "input", "nan": 1, "inf": 1, "samples": [2, 5]}
    assert d["diagnosis"]["fix"]["kind"] == "clean_input"
    assert "[2, 5]" in d["diagnosis"]["explanation"]


def test_nonfinite_parameters_are_reported_before_replay(tmp_path):
    x, y, s = nanmodels.classifier_step()
    s["fc.bias"][1] = float("inf")
    p = tmp_path / "bad_w.pt"
    torch.save({"x": x, "y": y, "state": s}, p)
    d = analyze(p, model="nanmodels:classifier", loss="nll_loss").to_json()
    assert d["verdict"] == "nonfinite_parameters"
    assert d["nonfinite_leaves"] == [{"name": "fc.bias", "role": "parameter", "nan": 0, "inf": 1, "shape": [5]}]
    assert d["diagnosis"]["fix"]["kind"] == "restore_parameters"
