"""The candidates of one culprit share the forward up to the first call any of them patches (replay/upstream.py):
each replays only the rest of the forward and one backward through its part and the shared one. Every candidate's
outcome — finite or not, its loss, its gradient norms, its no-op check, the ε probes' — must be exactly what a
replay from the first node gives (the same nodes on the same values, on this machine), including after a
candidate that fails (the shared part is released for its instrumented replay and built again)."""

from __future__ import annotations

import json

import pytest

from nanreplay.analysis import analyze
from nanreplay.replay import upstream
from tests.segmented import CASES, snapshot


def _diagnosis(path, monkeypatch, shared: bool) -> tuple[dict, list[bool]]:
    built, real = [], upstream.build

    def spy(*a, **k):
        u = real(*a, **k) if shared else None
        built.append(u is not None)
        return u
    with monkeypatch.context() as m:
        m.setattr(upstream, "build", spy)
        d = analyze(path).to_json()
    return json.loads(json.dumps(d["diagnosis"], default=str)), built


@pytest.mark.parametrize("case,shared", [("dist", True), ("relu_log", True), ("masked_log", False)])
def test_shared_forward_gives_every_candidate_the_same_outcome(tmp_path, monkeypatch, case, shared):
    """dist: an ε and its ε × 100 probe; relu_log: xlogy and its comparison where the expression ends; masked_log:
    one candidate, one replay (it fails: its instrumented replay follows), nothing to share."""
    path = snapshot(tmp_path, CASES[case])
    on, built = _diagnosis(path, monkeypatch, shared=True)
    off, _ = _diagnosis(path, monkeypatch, shared=False)
    assert (bool(built) and built[0]) is shared
    assert on == off
    replays = [c for c in on["candidates"] if c.get("replay")]
    assert replays and all(c["replay"]["loss"] is not None or c["verified"] is False for c in replays)
