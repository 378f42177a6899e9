"""Fixes as edits the user can apply (#38), judged by applying them: real training loops (applytrain.py) break under
NanGuard, each snapshot is analyzed with no flags in a fresh python where the training code cannot be imported, the
fix's `edits` are applied to a copy of the training file, and the copy trains on — every step finite, the healthy
steps' losses unchanged."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from isolation import ROOT, analyze_isolated, apply_edits

from tolerance import close

HERE = Path(__file__).resolve().parent
KINDS = ("mdn", "ce", "attn", "bce", "bce_block", "lr")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def marked(kind: str) -> int:
    return next(i for i, ln in enumerate((HERE / "applytrain.py").read_text().splitlines(), 1)
                if ln.rstrip().endswith(f"# CULPRIT: {kind}"))


def losses(folder: Path) -> dict:
    res = subprocess.run([sys.executable, "applytrain.py", "--losses", *KINDS], cwd=folder, capture_output=True,
                         text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("apply")
    proj = root / "proj"
    proj.mkdir()
    (proj / "applytrain.py").write_text((HERE / "applytrain.py").read_text())
    res = subprocess.run([sys.executable, "applytrain.py", str(root / "snaps"), *KINDS], cwd=proj,
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = dict(ln.split()[:2] for ln in res.stdout.splitlines() if len(ln.split()) == 2 and ln.split()[0] in KINDS)
    assert set(rows) == set(KINDS), res.stdout
    out = analyze_isolated(list(rows.values()), root / "elsewhere", also_blocked=("applytrain",))
    out = {k: out[rows[k]] for k in KINDS}
    fixed = root / "fixed"  # every loop's fix applied to one copy: the loops are separate functions
    fixed.mkdir()
    (fixed / "applytrain.py").write_text((HERE / "applytrain.py").read_text())
    for k in KINDS:
        apply_edits(fixed / "applytrain.py", out[k]["diagnosis"]["fix"]["edits"])
    advised = re.search(r"group\['lr'\] = ([0-9.e+-]+)", out["lr"]["diagnosis"]["fix"]["code"])
    assert advised, out["lr"]["diagnosis"]["fix"]["code"]  # the lr is advice (its line is not in the snapshot): by hand
    code = (fixed / "applytrain.py").read_text()
    (fixed / "applytrain.py").write_text(code.replace("LR_TOO_HIGH = 3.0", f"LR_TOO_HIGH = {advised.group(1)}"))
    return out, losses(proj), losses(fixed)


def _trains_on(runs, kind: str) -> None:
    """The loop as written breaks; with the fix's edits applied it trains every step, the healthy ones unchanged."""
    before, after = runs[1][kind], runs[2][kind]
    text = (HERE / "applytrain.py").read_text()
    STEPS, BAD = (int(v) for v in text.split("STEPS, BAD = ", 1)[1].splitlines()[0].split(", "))  # noqa: N806
    assert not before["finite"] and after["finite"] and len(after["losses"]) == STEPS, after
    assert all(close(a, b) for a, b in zip(before["losses"][:BAD], after["losses"][:BAD], strict=True)), (before, after)


def test_a_log_of_a_sum_of_densities_made_on_the_line_above_is_fixed_on_both_lines(runs):
    d = runs[0]["mdn"]
    assert d["culprit"]["source"]["line"] == marked("mdn") and d["diagnosis"]["cause"] == "logsumexp_underflow"
    fix = d["diagnosis"]["fix"]
    assert fix["verified"] is True and fix["tested_as"] == "line", fix["verification"]
    first, second = fix["edits"]
    assert (first["line"], second["line"]) == (marked("mdn") - 1, marked("mdn"))
    assert first["before"].startswith("dens = ") and first["after"].startswith("log_dens = ")
    assert "torch.exp" not in first["after"] and "torch.logsumexp(log_dens" in second["after"]
    assert (fix["before"], fix["after"]) == (second["before"], second["after"])  # the culprit line's edit
    assert all(e["after"] in fix["code"] for e in fix["edits"])
    _trains_on(runs, "mdn")


def test_a_cross_entropy_whose_targets_are_all_ignored_gets_its_line_rewritten(runs):
    d = runs[0]["ce"]
    assert d["culprit"]["source"]["line"] == marked("ce") and d["diagnosis"]["cause"] == "empty_reduction"
    fix = d["diagnosis"]["fix"]
    assert fix["verified"] is True and fix["tested_as"] == "line", fix["verification"]
    (edit,) = fix["edits"]
    assert "reduction='sum'" in edit["after"] and "!= IGNORE).sum().clamp_min(1)" in edit["after"]
    _trains_on(runs, "ce")


def test_a_float16_attention_product_that_overflows_is_computed_in_float32_up_to_its_softmax(runs):
    d = runs[0]["attn"]
    assert d["culprit"]["source"]["line"] == marked("attn") and d["diagnosis"]["cause"] == "fp16_overflow"
    assert d["culprit"]["op"] == "aten.bmm.default"
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "float32_softmax" and fix["verified"] is True and fix["tested_as"] == "line", fix
    product, softmax = fix["edits"]
    assert product["line"] == marked("attn") and "q.float() @ k.transpose(-2, -1).float()" in product["after"]
    assert softmax["line"] == marked("attn") + 2 and softmax["after"] == "w = att.softmax(-1).to(torch.float16)"
    _trains_on(runs, "attn")


def test_a_bce_on_the_probabilities_a_model_returns_is_computed_from_its_logits(runs):
    d = runs[0]["bce"]
    assert d["culprit"]["source"]["line"] == marked("bce") and d["diagnosis"]["cause"] == "bce_saturated"
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "bce_with_logits" and fix["verified"] is True and fix["tested_as"] == "line", fix
    model, loss = fix["edits"]
    assert model["before"].startswith("return torch.sigmoid(") and model["after"].startswith("return self.fc2(")
    assert "logsigmoid(p)" in loss["after"] and "logsigmoid(-p)" in loss["after"] and "torch.log(" not in loss["after"]
    assert "holds the logits" in fix["reasoning"]  # the model now returns logits: the user is told
    _trains_on(runs, "bce")


def test_a_bce_on_a_sigmoid_made_a_line_above_gets_that_line_split_into_its_logits(runs):
    d = runs[0]["bce_block"]
    fix = d["diagnosis"]["fix"]
    assert d["culprit"]["source"]["line"] == marked("bce_block") and fix["verified"] is True, fix
    made, loss = fix["edits"]
    assert (made["line"], made["after"]) == (marked("bce_block") - 1, "logits = z.squeeze(-1)")
    assert "logsigmoid(logits)" in loss["after"] and "logsigmoid(-logits)" in loss["after"]
    _trains_on(runs, "bce_block")


def test_a_run_whose_sgd_rate_is_too_high_is_told_a_rate_from_its_history_that_trains(runs):
    d = runs[0]["lr"]
    assert d["diagnosis"]["cause"] == "training_diverged"
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "lower_lr_clip_grads" and fix["edits"] == [] and fix["before"] is None  # advice, honestly
    assert "grew" in fix["code"] and "stable only below" in fix["code"]
    before, after = runs[1]["lr"], runs[2]["lr"]
    assert not before["finite"] and after["finite"] and after["losses"][-1] < after["losses"][0], (before, after)
    assert after["losses"][0] == before["losses"][0]  # the same model and batch before any update


def test_the_report_shows_a_fix_of_several_lines_as_one_diff_with_a_hunk_each(runs):
    from nanreplay.report.markdown import markdown_summary
    text = markdown_summary(runs[0]["mdn"])
    fix = runs[0]["mdn"]["diagnosis"]["fix"]
    for e in fix["edits"]:
        assert f"@@ {e['file']}:{e['line']} @@" in text
        assert f"- {e['before']}" in text and f"+ {e['after']}" in text
    from nanreplay.report.html import render_html
    page = render_html(runs[0]["mdn"]).replace("<wbr>", "")
    assert page.count('<div class="hunk">') == 2 and f"applytrain.py:{fix['edits'][0]['line']}</div>" in page
