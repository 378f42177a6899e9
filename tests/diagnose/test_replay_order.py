"""Candidates are replayed exact reformulation first (diagnose/engine.replay_order), whatever order the rule
listed them in: its replay is the same-step reference every ε after it is judged against, and where it verifies
nothing else is replayed."""

from __future__ import annotations

import dataclasses

from nanreplay.diagnose import engine
from nanreplay.diagnose.model import RULES
from nanreplay.enums import FixKind


def test_the_exact_form_is_replayed_first_even_when_the_rule_lists_it_last(analyzed, monkeypatch):
    real = RULES.answer

    def reversed_fixes(site):
        d = real(site)
        return dataclasses.replace(d, fixes=list(reversed(d.fixes)))
    monkeypatch.setattr(RULES, "answer", reversed_fixes)
    d = analyzed("zero_log_zero")["diagnosis"]
    kinds = [c["kind"] for c in d["candidates"]]
    assert kinds == ["xlogy", "clamp"]  # the rule now lists clamp first; xlogy is still replayed first
    assert d["candidates"][0]["verified"] is False and d["fix"]["kind"] == "clamp" and d["fix"]["verified"] is True


def test_rule_order_kept_among_the_rest():
    fixes = [type("F", (), {"kind": FixKind(k)})() for k in ("epsilon", "xlogy", "clamp", "log_softmax")]
    assert [f.kind for f in engine.replay_order(fixes)] == ["xlogy", "log_softmax", "epsilon", "clamp"]
