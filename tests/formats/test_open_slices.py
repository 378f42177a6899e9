"""Open-ended slices (`x[..., 1:]`, as every causal-LM loss shifts its labels) record their end as 2**63 - 1:
the program must accept the whole int64 range aten takes, and still refuse anything beyond it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from nanreplay import NanGuard
from nanreplay.analysis import analyze
from nanreplay.errors import SnapshotError


class Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)[..., 1:]  # LINE: open slice
        return (h / h.sum() * 0).sum() / (h * 0).sum()  # 0/0


def _snapshot(tmp_path):
    torch.manual_seed(0)
    model = Shifted()
    guard = NanGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), folder=tmp_path)
    x = torch.randn(3, 4)
    guard.begin(x)
    assert not guard.loss_ok(model(x))
    return guard.last_snapshot


def test_an_open_ended_slice_travels(tmp_path):
    path = _snapshot(tmp_path)
    program = json.loads(torch.load(path, weights_only=True)["step_program"])
    ends = [n["args"][3] for n in program["nodes"] if n["op"] == "aten.slice.Tensor"]
    assert 2**63 - 1 in ends
    d = analyze(path, verify=False).to_json()
    assert d["verdict"] == "culprit_found" and d["culprit"]["op"].startswith("aten.div")


def test_an_integer_beyond_int64_is_refused(tmp_path):
    path = _snapshot(tmp_path)
    snap = torch.load(path, weights_only=True)
    program = json.loads(snap["step_program"])
    node = next(n for n in program["nodes"] if n["op"] == "aten.slice.Tensor")
    node["args"][3] = 2**63
    snap["step_program"] = json.dumps(program)
    torch.save(snap, tmp_path / "crafted.pt")
    with pytest.raises(SnapshotError, match="must be an integer"):
        analyze(tmp_path / "crafted.pt", verify=False)
