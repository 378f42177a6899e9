"""The precision probe's forward culprit asked of its segment first (nanreplay/seeded.py): the instrumented replay
keeps the values live at each segment's start, and the float64 copy runs from the culprit's segment only.

A backward culprit's forward inputs (the report shows them) come from the boundary kept before it too.
Whatever the segment says, each row must be the row the whole-step probe gives (a derived row adds `derived`
and nothing else): a zero the segment makes itself (ReLU) fails in float64 too, and is answered without the
step; a zero that came in through the boundary — an underflow upstream that float64 does not have, or a
ReLU's exact zero that it does — is not, and the whole step decides.
"""

from __future__ import annotations

import pytest

from nanreplay import seeded, verify
from nanreplay.analysis import analyze
from tests.segmented import CASES, snapshot
from tests.tolerance import close


def _analyze(path, monkeypatch, *, seeded_on: bool):
    answers, calls = [], []
    real, one = seeded.culprit_answer, verify._probe_one

    def spy(*a, **k):
        answers.append(real(*a, **k) if seeded_on else None)
        return answers[-1]

    def count(*a, **k):
        calls.append(k.get("seeded_ok", True))
        return one(*a, **k)
    with monkeypatch.context() as m:
        m.setattr(seeded, "culprit_answer", spy)
        if not seeded_on:  # a backward culprit's forward inputs from the step's start, as before
            m.setattr(seeded, "op_inputs", lambda *a, **k: None)
        m.setattr(verify, "_probe_one", count)
        d = analyze(path, verify=False).to_json()
    return d, answers, calls


@pytest.mark.parametrize("case", list(CASES))
def test_rows_as_the_whole_step_gives_them(tmp_path, monkeypatch, case):
    path = snapshot(tmp_path, CASES[case], autocast=case.endswith("_bf16"))
    new, answers, calls = _analyze(path, monkeypatch, seeded_on=True)
    old, _, _ = _analyze(path, monkeypatch, seeded_on=False)
    assert new["culprit"] == old["culprit"]  # (a backward culprit's forward inputs: from the kept boundary, the same)
    if case == "dist":
        assert new["culprit"]["forward_inputs"][0]["zeros"] > 0
    assert new["culprit"]["phase"] == ("backward" if case.startswith(("dist", "masked_log")) else "forward")
    assert len(new["precision"]) == (2 if case.endswith("_bf16") else 1)
    rows = [{k: v for k, v in r.items() if k != "derived"} for r in new["precision"]]
    if case.startswith("dist"):  # the loss comes from a forward seeded with the step's values: close, not equal
        for r, o in zip(rows, old["precision"], strict=True):
            assert close(r.pop("loss"), o.pop("loss"), 1e-5)
    assert rows == old["precision"]
    assert not any("derived" in r for r in old["precision"])
    if case.endswith("_bf16"):  # one answer per row, each from the segment: the rows answered without a step
        assert len(answers) == 2 and all(a is not None and a[0] == seeded.FAILS for a in answers)
        assert all("derived" in r for r in new["precision"]) and len(calls) == 2
        return
    (answer,) = answers
    if case in ("relu_log", "dist"):  # the segment makes its zero itself: float64 fails there too, no step replayed
        assert answer is not None and answer[0] == seeded.FAILS and answer[1] > 0
        assert "derived" in new["precision"][0] and len(calls) == 1
    elif case in ("underflow", "masked_log"):  # float64 has no underflow: finite there, and the whole step agrees
        assert answer is not None and answer[0] == seeded.FINITE
        assert new["precision"][0]["grads_finite"] is True and calls == [True]
    else:  # a ReLU's zeros at the boundary: moved, finite; the whole step does not agree, and the probe as it was
        assert answer is not None and answer[0] == seeded.FINITE  # decides (the tripwire)
        assert calls == [True, False] and new["precision"][0]["loss_finite"] is False
