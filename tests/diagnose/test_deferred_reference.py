"""The ε × 100 probe that judges an ε candidate is replayed with its no-op check's float64 reference deferred
(noop.Deferred): the check is read only where the probe's loss and the candidate's disagree, or by the candidate at
ε × 100 that reuses the probe. Where neither happens no float64 forward is made; where the losses disagree the
probe is replayed again against the reference. Either way the diagnosis must be exactly the full path's, where the
probe is checked against the float64 step at once."""

from __future__ import annotations

import json

import pytest

from nanreplay import noop, replay
from nanreplay.analysis import analyze
from tests.segmented import CASES, VERIFY_CASES, snapshot


def _diagnosis(path, monkeypatch, deferred: bool) -> tuple[dict, list[int], int]:
    asked, forwards = [], []
    real_at, real_outputs = noop.Deferred.at, replay.outputs_at

    def at(self, c):
        asked.append(c)
        return real_at(self, c)

    def outputs_at(*a, **k):
        forwards.append(1)
        return real_outputs(*a, **k)
    with monkeypatch.context() as m:
        m.setattr(noop.Deferred, "at", at)
        m.setattr(replay, "outputs_at", outputs_at)
        if not deferred:  # the full path: the probe is checked against the step's float64 values at once
            m.setattr(noop.Float64Reference, "made", property(lambda self: True))
        d = analyze(path).to_json()
    return json.loads(json.dumps(d["diagnosis"], default=str)), asked, len(forwards)


@pytest.mark.parametrize("case,forwards", [("dist", 0), ("over_zero", 1)])
def test_the_deferred_reference_gives_the_full_diagnosis(tmp_path, monkeypatch, case, forwards):
    """dist: ε verifies, its probe at ε × 100 moves values beyond rounding (the reference is asked) and agrees on
    the loss: no float64 forward at all. over_zero: x / clamp(..., 0, 1) — every ε sets the loss, the losses disagree, so
    the deferred check must not stand: the probe is replayed against the float64 step (made once)."""
    path = snapshot(tmp_path, {**CASES, **VERIFY_CASES}[case])
    lean, asked, made = _diagnosis(path, monkeypatch, deferred=True)
    full, asked_full, made_full = _diagnosis(path, monkeypatch, deferred=False)
    assert lean == full
    assert asked and not asked_full  # the shortcut was taken, and only on the lean side
    assert made == forwards and made_full == 1
    fix = lean["fix"]
    if case == "dist":
        assert fix["kind"] == "epsilon" and fix["verified"] is True
        assert "does not move when ε changes by two decades" in fix["verification"]
    else:
        assert not any(c["verified"] for c in lean["candidates"])
        assert "moves when ε changes by two decades" in lean["candidates"][0]["verification"]
