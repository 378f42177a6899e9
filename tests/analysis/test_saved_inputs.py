"""A backward culprit's forward inputs read off the culprit itself (nanreplay/analysis/saved.py): log's `x` is the
divisor of LogBackward0's division, pow's `x` the base of PowBackward0's pow. On plain-dict `--model` steps, the
same statistics as the second look that replays the forward up to the op, and that look is not made."""

from __future__ import annotations

import pytest

import causes
import nanmodels
from nanreplay.analysis import analyze, contract, saved


@pytest.mark.parametrize("registry, name, node", [(nanmodels.CASES, "log_softmax", "LogBackward0"),
                                                  (causes.CASES, "pow_at_zero", "PowBackward0")])
def test_forward_inputs_from_the_culprit_are_the_second_looks(tmp_path, monkeypatch, registry, name, node):
    c = registry[name]
    path = c.save(tmp_path / f"{name}.pt")
    looks = []
    real = contract.forward_op_inputs
    monkeypatch.setattr(contract, "forward_op_inputs", lambda *a, **k: looks.append(a) or real(*a, **k))
    new = analyze(path, model=c.model_spec, loss=c.loss, verify=False).to_json()
    assert new["culprit"]["backward_node"] == node and new["culprit"]["phase"] == "backward"
    assert looks == []  # no forward replayed to find the op's inputs
    monkeypatch.setattr(saved, "forward_inputs", lambda ev, op: None)  # the second look, as before
    old = analyze(path, model=c.model_spec, loss=c.loss, verify=False).to_json()
    assert len(looks) == 1
    assert new["culprit"]["forward_inputs"] == old["culprit"]["forward_inputs"]  # same values, same stats function
    (x,) = new["culprit"]["forward_inputs"]
    assert x["arg"] == "self" and x["zeros"] > 0 and x["role"]
    assert {k: v for k, v in new.items() if k != "stats"} == {k: v for k, v in old.items() if k != "stats"}
