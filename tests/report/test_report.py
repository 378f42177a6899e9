"""The HTML report: every section that applies, checked from structured data.

Sections are checked on the view model (`report.build_view`, fed what
`report.gather_sources` read, as `render_html` does) and on the parsed page
(`html.parser`), never by comparing whole HTML strings.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from nanreplay import report
from nanreplay.analysis import Analysis, analyze
from nanreplay.report import html as report_html
from samples import EXPECTED, SAMPLES

ROOT = Path(__file__).resolve().parents[2]
SIZE_BUDGET = 500_000
ALL_SECTIONS = {"verdict", "anomaly", "source", "chain", "culprit-stats", "leaves", "activations", "gradients", "shapes",
                "history", "precision", "environment", "reproduce"}


class Page(HTMLParser):
    """A parsed report: every tag with its attributes, the text of each <section>, script and style bodies."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: dict[str, list[str]] = defaultdict(list)
        self.sections: list[str] = []
        self.scripts: list[str] = []
        self.styles: list[str] = []
        self._open: list[str] = []
        self._raw: tuple[str, list[str]] | None = None
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "section":
            self._open.append(a.get("id") or "")
            self.sections.append(a.get("id") or "")
        if tag in ("script", "style"):
            self._raw = (tag, [])

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if tag == "section" and self._open:
            self._open.pop()
        if tag in ("script", "style") and self._raw:
            (self.scripts if tag == "script" else self.styles).append("".join(self._raw[1]))
            self._raw = None

    def handle_data(self, data):
        if self._raw:
            self._raw[1].append(data)
        elif self._open:
            self.text[self._open[-1]].append(data)

    def section_text(self, sid: str) -> str:
        return re.sub(r"\s+", " ", " ".join(self.text.get(sid, [])))

    def attr_values(self, name: str) -> list[str]:
        return [a[name] for _, a in self.tags if a.get(name) is not None]


def _flags(name: str) -> dict:
    # the samples are native snapshots: model and loss travel inside; --source names this checkout
    return {"source": [str(ROOT)]}


_analyses: dict[str, Analysis] = {}


def sample_analysis(name: str) -> Analysis:
    """Each sample is analyzed once per test session (replay is the slow part)."""
    if name not in _analyses:
        _analyses[name] = analyze(SAMPLES / f"{name}.pt", **_flags(name))
    return _analyses[name]


def render(a, tmp_path: Path, name: str = "report.html") -> tuple[Path, Page]:
    out = tmp_path / name
    report.write_report(a, str(out))
    return out, Page(out.read_text(encoding="utf-8"))


def view(a) -> report.ReportView:
    """The view model as render_html builds it: the source files read first, then the views (which read nothing)."""
    return report.build_view(a, report.gather_sources(a))


def text_of(line: report.SourceLine) -> str:
    return "".join(t.text for t in line.tokens)


# ------------------------------------------------------------------ every sample snapshot

# sample -> (input index, column) the stats table must flag as the offending value
OFFENDING = {
    "sqrt_zero": (1, "zeros"),
    "log_zero": (0, "zeros"),
    "sqrt_negative": (0, "negatives"),
    "zero_norm": (1, "zeros"),
    "zero_log_zero": (0, "zeros"),
    "log_softmax": (1, "zeros"),
    "fp16_overflow": None,  # modest inputs, overflowing product: the output and a float16 note carry it
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_report_renders_every_section_that_applies(name, tmp_path):
    a = sample_analysis(name)
    d = a.to_json()
    c = d["culprit"]
    out, page = render(a, tmp_path)
    v = view(a)

    # what is on the page: native samples carry their training history; none has non-finite leaves
    diff = d.get("differential") or {}  # a fused culprit's kernel replay; the guard's re-run (samples made since it)
    expected = ALL_SECTIONS - {"leaves"} | {s for s in ("kernel", "machine") if diff.get(s)}
    assert len(d["snapshot_info"]["history"]) == d["snapshot_info"]["step"] + 1
    assert set(page.sections) == expected
    assert [s.id for s in v.sections] == [s for s in page.sections]  # the nav lists them in page order
    assert {h for h in page.attr_values("href")} == {f"#{s}" for s in expected}
    assert out.stat().st_size < SIZE_BUDGET

    # 1. the banner: the user's line first, then what happened there (the aten op after it), module,
    #    file:line, cause, one sentence of why, the fix with its badge
    b = v.banner
    assert b.verdict == "culprit_found" and b.tone == "bad"
    assert b.line.code == c["source"]["code"].strip() and b.line.where == f"{c['source']['file']}:{c['source']['line']}"
    assert not b.headline.startswith("aten.") and c["phase"] in b.headline and c["op"] in b.subline
    assert b.why and "`" not in "".join(seg.text for seg in b.why)
    assert b.cause == d["diagnosis"]["title"]
    facts = {f.label: f.value for f in b.facts}
    assert facts["source"].startswith(f"{c['source']['file']}:{c['source']['line']}")
    assert facts["module"] == report.module_label(c["module"], d["model"]["class"])
    fix = d["diagnosis"]["fix"]
    if fix["verified"]:
        assert b.fix.badge.text == "✓ verified by replay" and b.fix.badge.tone == "ok"
    elif fix["verified"] is None:  # not replayable (fp16_overflow: the training's lr and clipping): said, muted
        assert b.fix.badge.tone == "muted" and "not replayed" in b.fix.verification
    else:  # it replayed finite, but the loss moves with eps (log_zero): shown as such, not as verified
        assert b.fix.badge.tone == "bad" and "finite but implausible" in b.fix.verification
    if fix["before"]:
        assert [dl.text for dl in b.fix.diff if dl.sign == "-"] == fix["before"].splitlines()
        assert [dl.text for dl in b.fix.diff if dl.sign == "+"] == fix["after"].splitlines()
    else:
        assert b.fix.code == fix["code"]
    if fix["epsilon"] is not None:
        assert f"ε = {fix['epsilon']:g}" in b.fix.label
    verdict_text = page.section_text("verdict")
    for needle in (c["op"], d["diagnosis"]["title"], f"{c['source']['file']}:{c['source']['line']}",
                   "verified by replay" if fix["verified"] else "not replayed" if fix["verified"] is None
                   else "finite but implausible"):
        assert needle in verdict_text

    # 2. anomaly mode: the answer agrees with the analysis, with the seed's Inf-vs-NaN point when it is late/silent
    am = d["anomaly_mode"]
    if am["raises"] and am["agrees_with_culprit"]:
        assert v.anomaly.answer == "Yes"
    elif am["raises"]:
        assert v.anomaly.answer == "Yes, at a later node" and v.anomaly.node == am["node"]
        assert am["node"] in page.section_text("anomaly")
    else:
        assert v.anomaly.answer == "No"
    assert v.anomaly.quote_seed == (c["kind"] == "inf" and not am.get("agrees_with_culprit"))

    # 3. source: context read from the file, the culprit line marked and equal to the recorded code
    s = v.source
    assert s.origin == "file" and len(s.lines) > 1
    (marked,) = [ln for ln in s.lines if ln.mark == "culprit"]
    assert marked.number == c["source"]["line"] and text_of(marked).strip() == c["source"]["code"]

    # 4. chain: every event shown (folded runs included), the culprit marked once, ends at the failure
    ch = v.chain
    shown = [e for g in ch.groups for e in g.events]
    assert [e.index for e in shown] == [e["index"] for e in d["chain"]]
    assert [e.index for e in shown if e.culprit] == [c["event"]]
    assert ch.flow[-1].role == "failure" and ch.flow[0].role in ("origin", "literal")
    assert all(g.summary for g in ch.groups if g.collapsed)

    # 5. culprit inputs/output: one row per input, the offending value flagged
    st = v.stats
    assert len(st.rows) == len(c["inputs"])
    cols = st.columns[1:]
    flagged = {(i, cols[j]) for i, r in enumerate(st.rows) for j, cell in enumerate(r.cells) if cell.bad}
    if OFFENDING[name]:
        assert OFFENDING[name] in flagged, flagged
    else:
        assert st.output_bad and any("65504" in n for n in st.notes)
    assert not any(col in ("shape", "dtype") for _, col in flagged)

    # 6. activations: one bar per module call, the culprit's module marked
    av = v.activations
    assert len(av.chart.bars) == len(d["activations"])
    marked_mods = {r["module"] for r, bar in zip(d["activations"], av.chart.bars, strict=True) if bar.culprit}
    assert marked_mods == ({c["module"]} & {r["module"] for r in d["activations"]})
    bad = [bar for bar in av.chart.bars if bar.tone == "bad"]
    assert len(bad) == sum(1 for r in d["activations"] if r["absmax"] in ("nan", "inf"))
    assert any("max" in ln.label for ln in av.chart.lines)  # the dtype's max is drawn

    # 7. gradients: every parameter, worst first
    gt = v.gradients
    assert gt.total == len(d["gradients"]) and gt.omitted == 0
    bad_rows = [r[2].bad for r in gt.rows]
    assert bad_rows == sorted(bad_rows, reverse=True)  # all non-finite rows come first
    assert gt.nonfinite == sum(1 for g in d["gradients"] if g["nan"] or g["inf"])

    # 8. shapes, 10. precision / environment / reproduce
    assert v.shapes.total == len(d["gradient_shapes"]) and v.shapes.mismatches == 0
    assert len(v.precision.rows) == len(d["precision"])
    env = {f.label: f.value for f in v.environment.facts}
    machines = {r.label: r for r in v.environment.machines}
    assert machines["torch"].replayed == torch.__version__ and env["snapshot format"] == "native"
    assert machines["torch"].captured == d["snapshot_info"]["environment"]["torch"]  # what training recorded
    assert env["model rebuilt from"] == d["model"]["how"]
    cmd = shlex.split(v.reproduce.command)
    assert cmd[:3] == ["nanreplay", "analyze", d["snapshot"]]
    assert "--model" not in cmd and "--loss" not in cmd  # exactly how it was analyzed: no flags
    compile(v.reproduce.snippet, "<snippet>", "exec")


def test_no_external_references_and_a_policy_that_forbids_them(tmp_path):
    out, page = render(sample_analysis("fp16_overflow"), tmp_path)
    for tag, attrs in page.tags:
        for name in ("src", "href", "xlink:href", "action", "data", "poster", "srcset"):
            if name in attrs:
                assert attrs[name].startswith("#"), (tag, name, attrs[name])
    assert not {t for t, _ in page.tags} & {"link", "img", "iframe", "object", "embed", "base", "form", "audio", "video"}
    (css,) = page.styles
    (js,) = page.scripts
    assert "url(" not in css and "@import" not in css
    assert not re.search(r"\b(fetch|XMLHttpRequest|import\(|WebSocket|sendBeacon)\b", js)
    (csp,) = [a["content"] for t, a in page.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert "default-src 'none'" in csp

    def sha(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    assert f"script-src {sha(js)}" in csp and f"style-src {sha(css)}" in csp  # the page's own CSS/JS still run


def test_sizes_of_the_sample_reports_stay_small(tmp_path):
    sizes = {}
    for name in sorted(EXPECTED):
        out, _ = render(sample_analysis(name), tmp_path, f"{name}.html")
        sizes[name] = out.stat().st_size
    assert max(sizes.values()) < SIZE_BUDGET, sizes


# ------------------------------------------------------------------ markup from the snapshot is escaped

EVIL_MODULE = "<script>alert(1)</script>"
EVIL_DIR = "<img src=x onerror=alert(2)>"


def _assert_inert(html: str, page: Page, *raw: str) -> None:
    for r in raw:
        assert r not in html, f"unescaped {r!r}"
    assert page.scripts == [report_html.asset("report.js")]  # the only script is our own
    assert [t for t, _ in page.tags].count("script") == 1
    assert "img" not in {t for t, _ in page.tags}
    for tag, attrs in page.tags:
        assert not [k for k in attrs if k.startswith("on")], (tag, attrs)


def test_markup_in_module_names_and_paths_is_escaped(tmp_path, monkeypatch):
    folder = tmp_path / EVIL_DIR / "<script>models"
    folder.mkdir(parents=True)
    (folder / "xss_models.py").write_text(textwrap.dedent(f"""
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x):
                return torch.log(F.relu(self.fc(x))).mean()  # <b>log(0)</b>


        class Evil(nn.Module):
            def __init__(self):
                super().__init__()
                self.add_module({EVIL_MODULE!r}, Head())

            def forward(self, x):
                return getattr(self, {EVIL_MODULE!r})(x)


        def build():
            torch.manual_seed(0)
            return Evil()
        """))
    monkeypatch.syspath_prepend(str(folder))
    import xss_models

    snap = tmp_path / EVIL_DIR / "snap_<svg onload=alert(3)>.pt"
    torch.save({"x": torch.randn(6, 4), "state": xss_models.build().state_dict()}, snap)
    a = analyze(snap, model="xss_models:build")
    assert a.verdict == "culprit_found" and a.culprit["module"] == EVIL_MODULE
    assert EVIL_DIR in a.culprit["source"]["file"]
    out, page = render(a, tmp_path)
    html = out.read_text()
    _assert_inert(html, page, EVIL_MODULE, EVIL_DIR, "<svg onload", "<b>log(0)</b>")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert EVIL_MODULE in page.section_text("verdict") and EVIL_MODULE in page.section_text("activations")
    assert EVIL_DIR in page.section_text("environment")  # shown, as text


def test_markup_in_batch_keys_metadata_and_history_is_escaped(tmp_path):
    import nanmodels

    x = torch.randn(8, 4)
    x[1, 2] = float("nan")
    snap = tmp_path / "keys.pt"
    torch.save({"inputs": {"<iframe src=//evil>": x}, "state": nanmodels.probs().state_dict()}, snap)
    a = analyze(snap, model="nanmodels:probs", loss="nanmodels:log_loss")
    assert a.verdict == "nonfinite_input" and "<iframe" in a.nonfinite_leaves[0]["name"]
    a.snapshot_info.update(trigger="<script>alert(4)</script>", created="<b onmouseover=alert(5)>",
                           keys={"<i>k</i>": "<u>v</u>"}, step=3,
                           history=[{"step": 1, "loss": "<script>x</script>", "grad_norm": 1.0},
                                    {"step": 2, "loss": 1.0, "grad_norm": "inf"}])
    a.warnings.append("<script>alert(6)</script>")
    a.model["how"] = "--model <style>*{display:none}</style>"
    out, page = render(a, tmp_path)
    html = out.read_text()
    _assert_inert(html, page, "<iframe", "<script>alert(4)", "<b onmouseover", "<i>k</i>", "<script>x</script>",
                  "<script>alert(6)", "<style>*{")
    assert len(page.styles) == 1
    assert "<iframe src=//evil>" in page.section_text("leaves")


# ------------------------------------------------------------------ verdicts without a culprit


def _parts():
    import nanmodels

    torch.manual_seed(3)
    return torch.randn(6, 4), torch.randint(0, 5, (6,)), nanmodels.classifier().state_dict()


def test_nonfinite_input_report(tmp_path):
    x, y, s = _parts()
    x[2, 1] = float("nan")
    x[5, 0] = float("inf")
    torch.save({"x": x, "y": y, "state": s}, tmp_path / "bad_input.pt")
    a = analyze(tmp_path / "bad_input.pt", model="nanmodels:classifier", loss="nll_loss")
    _, page = render(a, tmp_path)
    v = view(a)
    assert set(page.sections) == {"verdict", "anomaly", "leaves", "environment", "reproduce"}
    assert v.banner.verdict_label == "NaN/Inf in the input batch" and "input batch" in v.banner.headline
    assert v.anomaly.answer == "Not checked"
    ((name, role, _shape, nan, inf, samples),) = v.leaves.rows
    assert (name.text, role.text, nan.text, inf.text, samples.text) == ("x", "input", "1", "1", "2, 5")
    assert nan.bad and inf.bad
    assert v.banner.fix.kind == "clean_input" and v.banner.fix.badge.tone == "muted"
    assert "nothing in the model to replay" in page.section_text("verdict")  # why it was not verified
    summary = report.terminal_summary(a, "r.html")
    assert "input batch" in summary and "x: 1 NaN, 1 Inf" in summary and "r.html" in summary


def test_nonfinite_parameters_report(tmp_path):
    x, y, s = _parts()
    s["fc.bias"][1] = float("inf")
    torch.save({"x": x, "y": y, "state": s}, tmp_path / "bad_w.pt")
    a = analyze(tmp_path / "bad_w.pt", model="nanmodels:classifier", loss="nll_loss")
    _, page = render(a, tmp_path)
    v = view(a)
    assert "leaves" in page.sections and "chain" not in page.sections and "source" not in page.sections
    assert v.banner.verdict_label == "NaN/Inf already in the weights"
    ((name, role, shape, nan, inf, _),) = v.leaves.rows
    assert (name.text, role.text, shape.text, inf.text) == ("fc.bias", "parameter", "5", "1") and inf.bad
    assert "fc.bias" in page.section_text("leaves") and v.banner.fix.kind == "restore_parameters"


def test_not_reproduced_report(tmp_path):
    import nanmodels

    model = nanmodels.tiny()
    torch.save({"x": torch.randn(3, 4), "y": torch.randint(0, 2, (3,)), "state": model.state_dict()},
               tmp_path / "fine.pt")
    a = analyze(tmp_path / "fine.pt", model="nanmodels:tiny", loss="cross_entropy")
    _, page = render(a, tmp_path)
    v = view(a)
    assert v.banner.tone == "ok" and v.banner.verdict_label == "not reproduced" and v.banner.fix is None
    assert {"gradients", "activations", "shapes"} <= set(page.sections)
    assert not {"source", "chain", "culprit-stats", "leaves"} & set(page.sections)
    assert all(r[2].text == "finite" for r in v.gradients.rows)
    assert "not reproduced" in report.terminal_summary(a, None)


# ------------------------------------------------------------------ a culprit inside a loss given by name


def test_culprit_in_a_named_loss_says_there_is_no_user_line(tmp_path, monkeypatch):
    """`--loss cross_entropy` over a fully masked row: the NaN is made inside F.cross_entropy."""
    (tmp_path / "masked_models.py").write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn


        class AllMasked(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x):
                logits = self.fc(x)
                mask = torch.zeros_like(logits, dtype=torch.bool)
                mask[1] = True
                return logits.masked_fill(mask, float("-inf"))


        def build():
            torch.manual_seed(0)
            return AllMasked()
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import masked_models

    torch.save({"x": torch.randn(5, 4), "y": torch.randint(0, 3, (5,)), "state": masked_models.build().state_dict()},
               tmp_path / "m.pt")
    a = analyze(tmp_path / "m.pt", model="masked_models:build", loss="cross_entropy", verify=False)
    assert a.culprit["module"] == "<loss>" and a.culprit["source"] is None
    v = view(a)
    facts = {f.label: f.value for f in v.banner.facts}
    assert "--loss cross_entropy" in facts["source"] and "no line of yours" in facts["source"]
    s = v.source
    assert s.note_first and "--loss cross_entropy" in s.note and "no source line of yours" in s.note
    # ... and it shows where its input came from: the -inf literal on the user's line
    (up,) = [ln for ln in s.lines if ln.mark == "upstream"]
    assert "masked_fill" in text_of(up) and not [ln for ln in s.lines if ln.mark == "culprit"]
    summary = report.terminal_summary(a, None)
    assert "(the loss)" in summary and "--loss cross_entropy" in summary

    # without any line of the user's on the chain, the note alone, never an empty code block
    d = copy.deepcopy(a.to_json())
    for e in d["chain"]:
        e["source"] = None
    s = view(d).source
    assert s.origin == "none" and s.lines == [] and "--loss cross_entropy" in s.note
    page = Page(report.render_html(d))
    assert "src" not in {a.get("class", "").split(" ")[0] for _, a in page.tags}


# ------------------------------------------------------------------ training history (native snapshots)


def test_history_section_marks_the_spike_and_the_non_finite_step(tmp_path):
    a = copy.deepcopy(sample_analysis("log_zero"))
    hist = [{"step": 100 + i, "loss": 2.0 / (1 + 0.1 * i), "grad_norm": 1.0 + 0.01 * i} for i in range(20)]
    hist += [{"step": 120, "loss": 1.5, "grad_norm": 4.0e5}, {"step": 121, "loss": "nan", "grad_norm": "inf"}]
    a.snapshot_info.update(format="native", step=121, trigger="loss", history=hist)
    v = view(a)
    h = v.history
    assert "grad-norm spike at step 120" in h.spike and "non-finite from step 121" in h.spike
    assert [m.label for m in h.chart.markers] == ["spike (step 120)", "non-finite (step 121)"]
    loss_panel, gn_panel = h.chart.panels
    assert (loss_panel.name, gn_panel.name, gn_panel.scale) == ("loss", "grad norm", "log")
    assert [d.title for d in loss_panel.dots if d.bad] == ["step 121: loss NaN"]
    assert [d.title for d in gn_panel.dots if d.bad] == ["step 121: grad norm +Inf"]
    assert len(h.rows) == 22 and h.rows[-1][1].bad and h.rows[-2][2].bad  # the spike's grad norm flagged
    _, page = render(a, tmp_path)
    assert page.sections.index("history") == page.sections.index("shapes") + 1
    assert "spike (step 120)" in page.section_text("history")


def test_history_without_a_spike_marks_the_snapshot_step():
    d = copy.deepcopy(sample_analysis("log_zero").to_json())
    d["snapshot_info"].update(step=9, history=[{"step": i, "loss": 1.0 - 0.05 * i, "grad_norm": 2.0} for i in range(10)])
    h = view(d).history
    assert h.spike == "" and [m.label for m in h.chart.markers] == ["snapshot (step 9)"]
    assert all(p.scale == "linear" for p in h.chart.panels) and all(len(p.lines) == 1 for p in h.chart.panels)


# ------------------------------------------------------------------ tables from synthetic data


def _synthetic(**over) -> dict:
    d = copy.deepcopy(sample_analysis("sqrt_zero").to_json())
    d.update(over)
    return d


def test_gradient_table_is_the_per_parameter_walk_worst_first():
    g = [
        {"name": "ok.weight", "shape": [2, 2], "has_grad": True, "mean": 0.1, "std": 0.2, "max_abs": 0.5, "nan": 0,
         "inf": 0},
        {"name": "frozen.weight", "shape": [2], "has_grad": False, "mean": None, "std": None, "max_abs": None,
         "nan": 0, "inf": 0},
        {"name": "dead.bias", "shape": [2], "has_grad": True, "mean": 0.0, "std": 0.0, "max_abs": 0.0, "nan": 0,
         "inf": 0},
        {"name": "big.weight", "shape": [3], "has_grad": True, "mean": 5.0, "std": 1.0, "max_abs": 9.0, "nan": 0,
         "inf": 0},
        {"name": "inf.bias", "shape": [4], "has_grad": True, "mean": "inf", "std": "nan", "max_abs": "inf", "nan": 0,
         "inf": 2},
        {"name": "nan.weight", "shape": [4], "has_grad": True, "mean": "nan", "std": "nan", "max_abs": "nan", "nan": 4,
         "inf": 0},
    ]
    gt = view(_synthetic(gradients=g)).gradients
    assert [r[0].text for r in gt.rows] == ["nan.weight", "inf.bias", "frozen.weight", "dead.bias", "big.weight",
                                            "ok.weight"]
    assert [r[2].text for r in gt.rows] == ["NaN", "Inf", "NO GRADIENT", "all zero", "finite", "finite"]
    assert (gt.nonfinite, gt.no_grad, gt.zero) == (2, 1, 1)
    assert gt.rows[0][6].sort == "Infinity" and gt.rows[2][6].sort == "-Infinity"  # NaN sorts worst, none lowest
    page = Page(report.render_html(_synthetic(gradients=g)))
    assert "NO GRADIENT" in page.section_text("gradients")
    assert ("table", {"class": "sortable grads stack"}) in page.tags


def test_gradient_shapes_flag_mismatches_first():
    rows = [{"module": "a", "output_shape": [2, 3], "grad_shape": [2, 3], "mismatch": False},
            {"module": "skip", "output_shape": [2, 3], "grad_shape": [2, 1], "mismatch": True},
            {"module": "unused", "output_shape": [4], "grad_shape": None, "mismatch": False},
            {"module": "a", "output_shape": [2, 3], "grad_shape": [2, 3], "mismatch": False}]
    sh = view(_synthetic(gradient_shapes=rows)).shapes
    assert (sh.mismatches, sh.no_grad, sh.total) == (1, 1, 4)
    assert [r[0].text for r in sh.rows] == ["skip", "unused", "a", "a (call 2)"]
    assert sh.rows[0][3].text == "MISMATCH" and sh.rows[0][3].bad and sh.rows[0][2].text == "2×1"
    assert "1 mismatch" in Page(report.render_html(_synthetic(gradient_shapes=rows))).section_text("shapes")


def test_long_propagation_runs_fold_but_stay_in_the_page():
    d = _synthetic()
    first = d["chain"][0]
    run = [dict(first, index=100 + i, role="propagation", op="aten.view.default") for i in range(30)]
    d["chain"] = [first, *run, dict(first, index=500, role="propagation", op="aten.detach.default")]
    d["failure"]["event"] = 500
    ch = view(d).chain
    assert [len(g.events) for g in ch.groups] == [1, 30, 1] and ch.groups[1].collapsed
    assert "30 propagation steps" in ch.groups[1].summary and "view ×30" in ch.groups[1].summary
    page = Page(report.render_html(d))
    assert [t for t, _ in page.tags].count("details") >= 1
    assert sum(1 for t, a in page.tags if t == "tr" and "data-event" in a) == 32  # folded, not dropped


def test_source_context_falls_back_to_the_recorded_line(tmp_path):
    d = _synthetic()
    src = d["culprit"]["source"]
    src.pop("context", None)  # no recorded context: the report may only read the file the analysis marked readable
    for path in (str(tmp_path / "gone.py"), "/etc/passwd", str(ROOT / "README.md")):
        src["path"] = path
        s = view(d).source
        assert s.origin == "recorded" and [text_of(ln) for ln in s.lines] == [src["code"]]
        assert "not readable" in s.note
    changed = tmp_path / "models.py"
    changed.write_text("\n".join(f"x{i} = {i}" for i in range(40)))
    src["path"] = str(changed)  # the file no longer says what was recorded at that line
    assert view(d).source.origin == "recorded"


def test_only_the_sources_step_reads_files():
    """gather_sources reads the culprit's file; build_view shows only what it was given."""
    d = sample_analysis("log_zero").to_json()
    src = d["culprit"]["source"]
    sources = report.gather_sources(d)
    assert list(sources) == [(src["path"], src["line"])]
    assert sources[(src["path"], src["line"])][src["line"]].strip() == src["code"].strip()
    s = report.build_view(d, {}).source  # nothing read: the line as recorded, as when the file is gone
    assert s.origin == "recorded" and [text_of(ln) for ln in s.lines] == [src["code"].strip()]
    s = report.build_view(d, sources).source
    assert s.origin == "file" and [ln.number for ln in s.lines if ln.mark == "culprit"] == [src["line"]]


def test_templates_do_no_arithmetic():
    """Every coordinate and count comes computed: a template expression holds no + - * / % (outside strings)."""
    for t in (ROOT / "nanreplay" / "report" / "templates").glob("*.j2"):
        for expr in re.findall(r"{{(.*?)}}|{%(.*?)%}", t.read_text(), flags=re.S):
            code = re.sub(r"'[^']*'|\"[^\"]*\"", "''", "".join(expr))
            assert not re.search(r"(?<![-+*/%])\s[-+*/%]\s", code), f"{t.name}: {code.strip()}"


# ------------------------------------------------------------------ the terminal summary mirrors the banner


def test_terminal_summary_mirrors_the_banner():
    a = sample_analysis("sqrt_zero")
    b = view(a).banner
    text = report.terminal_summary(a, "out/r.html")
    c = a.culprit
    for needle in (c["op"], c["backward_node"], f"{c['source']['file']}:{c['source']['line']}", b.cause,
                   "[verified by replay]", a.diagnosis["fix"]["after"], "PowBackward0", "out/r.html",
                   "failure  the gradient of encoder.2.bias became NaN"):
        assert needle in text, needle
    assert len(text.splitlines()) <= 10

    d = copy.deepcopy(a.to_json())
    d["diagnosis"]["fix"].update(verified=False, verification="replayed with the fix: loss still NaN")
    text = report.terminal_summary(d, None)
    assert "[did not verify]" in text and "(replayed with the fix: loss still NaN)" in text
    assert view(d).banner.fix.badge.tone == "bad"

    d["diagnosis"]["fix"].update(verified=None, verification=None)  # --no-verify
    fix = view(d).banner.fix
    assert (fix.badge.text, fix.badge.tone) == ("not replayed", "muted") and "--no-verify" in fix.verification
    assert "[not replayed]" in report.terminal_summary(d, None)


# ------------------------------------------------------------------ failures leave nothing behind


def test_a_failed_render_leaves_no_report(tmp_path, monkeypatch):
    a = sample_analysis("log_zero")
    old = tmp_path / "old.html"
    old.write_text("previous report")

    def broken(*_, **__):
        raise RuntimeError("template exploded")

    monkeypatch.setattr(report_html, "build_view", broken)
    for target in (old, tmp_path / "new.html"):
        with pytest.raises(RuntimeError):
            report.write_report(a, str(target))
    assert old.read_text() == "previous report" and not (tmp_path / "new.html").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.html"]


def test_a_failed_write_leaves_no_half_written_report(tmp_path, monkeypatch):
    class Exploding(str):
        def encode(self, *args, **kwargs):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_html, "render_html", lambda a, **kw: Exploding("<html>"))
    from nanreplay.errors import UsageError

    with pytest.raises(UsageError, match="cannot write the report"):
        report.write_report(sample_analysis("log_zero"), str(tmp_path / "r.html"))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ formatting helpers


@pytest.mark.parametrize("x, text", [(None, "—"), ("nan", "NaN"), ("inf", "+Inf"), ("-inf", "−Inf"), (0.0, "0"),
                                     (1e-9, "1e-09"), (0.0627688, "0.06277"), (65504.0, "6.55e+04"), (3, "3"),
                                     (math.nan, "NaN"), (True, "yes")])
def test_num(x, text):
    assert report.num(x) == text


# ------------------------------------------------------------------ non-editable install (slow: ~60 s)


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


@pytest.mark.slow
def test_wheel_installed_non_editably_renders_a_report(tmp_path):
    """The templates ship inside the wheel: a fresh venv with only the wheel renders a full report elsewhere.

    Slow (a fresh venv with torch from the local wheel cache): about a minute. Skip with -m "not slow".
    """
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "nanreplay", src / "nanreplay", ignore=shutil.ignore_patterns("__pycache__"))  # templates inside
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("nanreplay-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = _venv_python(venv)
    pip = [str(py), "-m", "pip", "install", "-q"]
    # torch pinned to this venv's version (installed from the local wheel cache), then the wheel alone
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}", "click", "jinja2", "pandas"], check=True,
                   capture_output=True, timeout=600)
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, capture_output=True, timeout=300)

    work = tmp_path / "elsewhere"  # not the checkout: only the installed package can be imported
    shutil.copytree(SAMPLES, work / "sample_snapshots", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    where = subprocess.run([str(py), "-c", "import nanreplay.report.html as r; print(r.__file__); print(r._template_dir())"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    module_file, template_dir = where.stdout.split()
    assert Path(module_file).is_relative_to(venv) and Path(template_dir).is_relative_to(venv)
    res = subprocess.run([str(venv / "bin" / "nanreplay"), "analyze", "sample_snapshots/sqrt_zero.pt",
                          "-o", "out.html"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    page = Page((work / "out.html").read_text())
    assert set(page.sections) == ALL_SECTIONS - {"leaves"} | {"machine"}  # the sample carries the guard's re-run
    assert "SqrtBackward0" in page.section_text("verdict") and page.scripts and page.styles
    assert "out.html" in res.stdout


def test_a_loss_the_snapshot_recorded_is_not_cited_as_a_flag(tmp_path):
    """A native snapshot whose culprit runs inside the guard's loss_fn (F.mse_loss overflowing float16): analyzed
    with no --loss, nothing says `--loss` (the user gave none); the loss is named as the snapshot recorded it."""
    import torch.nn.functional as F

    from nanreplay import NanGuard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, max_snapshots=1)
    for step in range(2):
        x, y = (torch.randn(3, 4) * (1 if step == 0 else 400)).half(), torch.zeros(3, 2).half()
        guard.begin(x, y, step=step)
        loss = F.mse_loss(model(x), y)
        if not guard.loss_ok(loss):
            break
        loss.backward()
    a = analyze(guard.last_snapshot, verify=False)
    d = a.to_json()
    assert d["culprit"]["module"] == "<loss>" and d["invocation"]["loss"] is None and d["model"]["loss"]
    v = view(a)
    facts = {f.label: f.value for f in v.banner.facts}
    for text in (report.terminal_summary(a, None), facts["source"], v.source.note):
        assert "--loss" not in text and d["model"]["loss"] in text, text
