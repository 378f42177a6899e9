"""What the reports say, checked against the analysis they come from: every shipped sample's golden JSON.

Each sentence has one source: the culprit's call is the user's (`user_call`), an Inf keeps its sign in the
triage summary, a count says "of N", each fix carries its own reasoning, the anomaly answer comes from the
anomaly analysis only, and a fix given as advice wraps in a ticket instead of scrolling.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from nanreplay.report import markdown_summary
from nanreplay.report.markdown import WIDTH
from nanreplay.report.views.banner import banner
from nanreplay.triage.groups import build_groups
from nanreplay.triage.markdown import markdown_summary as triage_markdown
from nanreplay.triage.rows import Item, make_row
from nanreplay.triage.worker import analysis_fields
from samples import names

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


ALL = [n for n in names() if (GOLDEN / f"{n}.json").exists()]


@pytest.mark.parametrize("name", ALL)
def test_a_forward_culprit_shows_the_users_call_not_the_aten_packet(name):
    d = golden(name)
    c = d["culprit"]
    sub = banner(d).subline
    if c["phase"] == "forward" and c.get("user_call"):
        assert f"called as {c['user_call']}" in sub and "torch.ops.aten" not in sub, sub


@pytest.mark.parametrize("name", ALL)
def test_each_alternative_carries_its_own_reasoning(name):
    fixes = golden(name)["diagnosis"].get("candidates") or []  # the fix and its alternatives
    reasons = [f.get("reasoning") for f in fixes if f.get("reasoning")]
    assert len(reasons) == len(set(reasons)), reasons
    for f in fixes:
        m = re.search(r"\beps = (\S+?):", f.get("reasoning") or "")
        if m and f.get("epsilon"):
            assert math.isclose(float(m.group(1)), f["epsilon"]), (f["epsilon"], f["reasoning"])


@pytest.mark.parametrize("name", ALL)
def test_the_explanation_says_of_anomaly_mode_only_what_the_anomaly_analysis_says(name):
    d = golden(name)
    am, text = d["anomaly_mode"], d["diagnosis"]["explanation"]
    for sentence in re.split(r"(?<=\.)\s+", text):
        if "anomaly" in sentence:
            said = am["node"] if am.get("raises") else "silent"
            assert said in sentence, (sentence, am)


def test_a_count_of_values_says_of_how_many():
    d = golden("sqrt_negative")
    x = d["culprit"]["inputs"][0]
    assert f"{x['negatives']} negative values of {math.prod(x['shape'])}" in d["diagnosis"]["explanation"]


def test_the_triage_summary_keeps_the_sign_of_an_inf():
    d = golden("log_zero")
    assert d["culprit"]["output"]["neginf"] and not d["culprit"]["output"]["posinf"]
    row = make_row(Item(path="s/log_zero.pt", rel="log_zero.pt", name="log_zero"),
                   {**analysis_fields(d), "report": "log_zero.html", "json": "log_zero.json"})
    groups = build_groups([row])
    doc = {"dir": "s", "nanreplay_version": "0", "options": {}, "summary": "", "groups": groups, "failures": [],
           "ranks": None, "ignored": [],
           "counts": {"snapshots": 1, "analyzed": 1, "failed": 0, "cached": 0, "groups": 1, "ignored": 0,
                      "failures": {}}}
    md = triage_markdown(doc)
    assert "log made −Inf in forward" in md, md


def test_a_fix_given_as_advice_wraps_in_a_ticket():
    d = golden("fp16_overflow")
    assert len(d["diagnosis"]["fix"]["code"]) > WIDTH  # one long comment line in the analysis
    md = markdown_summary(d)
    blocks = re.findall(r"```python\n(.*?)\n```", md, re.S)
    assert blocks and all(len(line) <= WIDTH for b in blocks for line in b.splitlines()), blocks
    def words(text: str) -> str:  # the advice's words, whatever lines and comment marks carry them
        return " ".join(w for ln in text.splitlines() for w in ln.lstrip("# ").split())

    assert words(blocks[-1]) == words(d["diagnosis"]["fix"]["code"])
