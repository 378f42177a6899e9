"""The no-op check's float64 reference is made in the middle of the fix's replay (the first time a patched value
moves beyond rounding), and it replays the step from its own start up to the last call any fix patches: its RNG
must not become the fix's. A line that runs twice, each time after a dropout, is asked at its first call: the
second dropout must draw the same mask in the fix's replay as in the same step run with the fixed line."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from nanreplay import analysis, noop
from tolerance import close

MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fcs = nn.ModuleList([nn.Linear(8, 64), nn.Linear(8, 64)])
        with torch.no_grad():
            for fc in self.fcs:
                fc.weight.mul_(60)  # confident logits: softmax underflows, to 0 and to subnormals

    def forward(self, x):
        out = 0
        for fc in self.fcs:  # the line runs twice, each time after a dropout: the fix rewrites both calls
            out = out + torch.log(torch.softmax(fc(F.dropout(x, 0.25)), dim=-1))
        return out


def build():
    torch.manual_seed(0)
    return Head()
'''


def test_the_float64_reference_leaves_the_fixs_random_draws_alone(tmp_path, monkeypatch):
    (tmp_path / "rngmodel.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import rngmodel
    model = rngmodel.build()
    torch.manual_seed(3)
    x = torch.randn(32, 8)
    with torch.no_grad():
        y = (model.fcs[0](x) + model.fcs[1](x)).argmax(-1)
    path = tmp_path / "snap.pt"
    torch.save({"x": x, "y": y, "state": model.state_dict()}, path)
    made = []
    real = noop.Float64Reference.at
    monkeypatch.setattr(noop.Float64Reference, "at", lambda self, c: made.append(self.made) or real(self, c))
    try:
        d = analysis.analyze(path, model="rngmodel:build", loss="nll_loss").to_json()
    finally:
        sys.modules.pop("rngmodel", None)
    fix = d["diagnosis"]["fix"]
    assert d["culprit"]["backward_node"] == "LogBackward0" and fix["kind"] == "log_softmax", (d["culprit"], fix)
    assert False in made  # the reference was made, during the fix's replay
    torch.manual_seed(0)  # the replay's RNG (Subject.prepare), then the step with the fixed line
    with torch.no_grad():
        want = F.nll_loss(sum(torch.log_softmax(fc(F.dropout(x, 0.25)), dim=-1) for fc in model.fcs), y)
    assert close(fix["replay"]["loss"], float(want)), (fix["replay"]["loss"], float(want))  # (another mask: 3% off)
