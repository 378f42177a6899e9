"""Generated from the reformulation table (nanreplay/diagnose/forms.py): every row's composition is driven to
its failure by a small fixture (tests/forms_cases.py), and the analysis must name the row's cause, offer the
row's exact form first, verify it by replay, and show as code exactly what it replayed. Then the fix is judged
by applying it: the shown line put into a copy of the fixture's file (or, where the fix is guidance, the same
change written by hand), and a few SGD steps trained on — the failing batch finite, a healthy batch's loss and
gradient unchanged."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import forms_cases
import pytest
import torch

from nanreplay import analysis
from nanreplay.diagnose.forms import TABLE
from nanreplay.diagnose.model import RULES
from tolerance import close

# Fixes that are guidance (they span more than the culprit's line): the change a user would write, by hand.
HAND = {
    "bce_with_logits": ("return -(k * torch.log(p := torch.sigmoid(h)) + (1 - k) * torch.log(1 - p)).mean()",
                        "return F.binary_cross_entropy_with_logits(h, k)"),
    "segment_softmax": ("e = torch.exp(h)",
                        "e = torch.exp(h - torch.full((2,), float('-inf')).scatter_reduce(0, IDX, h.detach(), "
                        "'amax')[IDX])"),
}


def test_every_row_has_a_fixture_and_a_rule():
    assert set(TABLE) == set(forms_cases.ROWS)
    assert {r.cause for r in TABLE.values()} <= {r.cause for r in RULES}


@pytest.fixture(scope="module")
def analyses(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forms")
    out = {}
    for name, c in forms_cases.CASES.items():
        out[name] = analysis.analyze(c.save(tmp / f"{name}.pt"), model=c.model_spec).to_json()
    return out


@pytest.mark.parametrize("name", sorted(TABLE))
def test_the_exact_form_is_offered_first_and_verified(analyses, name):
    row, d = TABLE[name], analyses[name]
    assert d["verdict"] == "culprit_found", d["verdict"]
    assert d["culprit"]["source"]["line"] == forms_cases.CASES_LINE(name)
    diag = d["diagnosis"]
    assert diag["cause"] == row.cause, (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert diag["candidates"][0]["kind"] == row.kind.value == fix["kind"], diag["candidates"][0]
    if row.in_data:  # no ε verifies a definition: the remedy is said, not replayed
        assert fix["verified"] is None and fix["replay"] is None and "in the data" in diag["explanation"]
        assert all(ln.startswith("#") for ln in fix["code"].splitlines())
        return
    assert fix["verified"] is True, fix["verification"]
    assert fix["epsilon"] is None  # an exact form, not an ε
    if fix["after"]:
        assert fix["tested_as"] == "line" and fix["code"] == fix["after"]  # the code shown is the code replayed
    else:
        assert name in HAND and fix["tested_as"] == "op", fix


def _train(module_name: str, name: str, batches: list[dict]) -> list[tuple[float, float]]:
    """(loss, |gradient of scale|) of a few SGD steps of the fixture's model from `module_name`."""
    mod = sys.modules[module_name]
    model = getattr(mod, f"form_{name}")()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    out = []
    for b in batches:
        opt.zero_grad()
        loss = model(*b["x"])
        loss.backward()
        out.append((loss.item(), model.scale.grad.abs().item()))
        opt.step()
    return out


@pytest.mark.parametrize("name", sorted(n for n in TABLE if not TABLE[n].in_data))
def test_the_fix_applied_trains_on(analyses, tmp_path, monkeypatch, name):
    fix = analyses[name]["diagnosis"]["fix"]
    before, after = (fix["before"], fix["after"]) if fix["after"] else HAND[name]
    src = Path(forms_cases.__file__).read_text().splitlines()
    b0 = before.splitlines()
    at = next(i for i in range(len(src)) if all(src[i + j].strip().startswith(b.strip()) for j, b in enumerate(b0)))
    indent = src[at][:len(src[at]) - len(src[at].lstrip())]
    src[at:at + len(b0)] = [indent + a for a in after.splitlines()]
    fixed = f"forms_fixed_{name}"
    (tmp_path / f"{fixed}.py").write_text("\n".join(src) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(fixed)
    try:
        healthy, bad = forms_cases.batch(name, healthy=True), forms_cases.batch(name)
        want = _train("forms_cases", name, [healthy])[0]
        got = _train(fixed, name, [healthy, bad, healthy])
    finally:
        sys.modules.pop(fixed, None)
    assert all(math.isfinite(v) for step in got for v in step), got  # no NaN, no Inf, the step after included
    assert close(got[0][0], want[0]) and close(got[0][1], want[1]), (got[0], want)  # healthy values unchanged
