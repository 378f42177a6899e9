"""Integer op arguments span int64: `x[:, 1:]` records its end as INT64_MAX, and such a step must load."""

from __future__ import annotations

import pytest
import torch

from nanreplay.capture.program import record_step
from nanreplay.formats.program import decode, to_json


class Slicer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.fc(x[:, 1:])


def test_an_open_ended_slice_round_trips():
    m, x = Slicer(), torch.randn(4, 3)
    rec = record_step(lambda: m(x), lambda out: out.sum(), model=m, batch={"inputs": x, "target": None})
    prog = decode(to_json(rec.program))
    ends = [a for n in prog.nodes if n.name == "aten.slice.Tensor" for a in n.args[2:4]]
    assert 2**63 - 1 in ends


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1])
def test_beyond_int64_is_refused(value):
    m, x = Slicer(), torch.randn(4, 3)
    rec = record_step(lambda: m(x), lambda out: out.sum(), model=m, batch={"inputs": x, "target": None})
    node = next(n for n in rec.program["nodes"] if n["op"] == "aten.slice.Tensor")
    node["args"][3] = value
    with pytest.raises(Exception, match="must be an integer"):
        decode(to_json(rec.program))
