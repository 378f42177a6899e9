"""The reports and a triage index in a real browser: headless Chromium (the distribution's package).

At a phone's width (420 px) and a desktop's (1280 px): no element sticks out of the
viewport, no console error, no Content-Security-Policy violation, chart text readable and
not cut at the chart's edge.
Printed to PDF: every code line is in the PDF's text whole (nothing clipped at a box edge),
and screen-only instructions are not; on A4 and on Letter the verdict box starts on page 1 and is
not split, and file names, code and options wrap only where a reader expects (never mid-word).
Select with `-m browser`; skipped, saying why, where Chromium (or poppler's pdftotext, for the print
check) is not installed.
"""

from __future__ import annotations

import re
import shutil

import pytest

from chromium import PAPER, Chromium, find, pdf_pages, pdf_text
from nanreplay import __version__, report
from nanreplay.analysis import analyze
from nanreplay.report.html import jinja_env
from nanreplay.report.views.environment import reproduce_view
from nanreplay.triage.groups import build_groups
from nanreplay.triage.index import render_index
from nanreplay.triage.rows import Item, failed, make_row
from nanreplay.triage.worker import analysis_fields
from samples import SAMPLES, flags, names

pytestmark = pytest.mark.browser

WIDTHS = (420, 1280)
MIN_CHART_FONT = 9.0  # px, as rendered: an SVG scaled down shrinks its text with it
CODE = "Array.from(document.querySelectorAll('pre.code, .src .line')).map(function (e) { return e.textContent; })"


@pytest.fixture(scope="module")
def browser():
    if find() is None:
        pytest.skip("headless Chromium not found on PATH (apt-get install chromium): real-browser checks skipped")
    with Chromium.start() as b:
        yield b


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """Every sample's report (linked back to an index, as triage writes them) and that index."""
    out = tmp_path_factory.mktemp("pages")
    rows = []
    for n in names():
        a = analyze(SAMPLES / f"{n}.pt", **flags(n))
        report.write_report(a, str(out / f"{n}.html"), index="index.html")
        fields = {**analysis_fields(a.to_json()), "report": f"{n}.html", "json": f"{n}.json"}
        rows.append(make_row(Item(path=str(SAMPLES / f"{n}.pt"), rel=f"{n}.pt", name=n), fields))
    rows.append(make_row(Item(path="broken.pt", rel="broken.pt", name="broken"),
                         failed("unreadable", "not a snapshot (not a torch.save file)")))
    groups = build_groups(rows)
    fails = [{"file": r["file"], "failure": r["failure"], "label": "unreadable", "reason": r["reason"]}
             for r in rows if r["status"] != "analyzed"]
    doc = {"schema": "nanreplay.triage/1", "nanreplay_version": __version__, "dir": "sample_snapshots",
           "options": {"model": None, "loss": None, "trust": False}, "summary": "",
           "counts": {"snapshots": len(rows), "analyzed": len(rows) - 1, "failed": 1, "cached": 0,
                      "groups": len(groups), "ignored": 0, "failures": {"unreadable": 1}},
           "groups": groups, "failures": fails, "ranks": None, "ignored": []}
    (out / "index.html").write_text(render_index(doc), encoding="utf-8")
    (out / "stress.html").write_text(report.render_html(_stress(analyze(SAMPLES / "sqrt_zero.pt").to_json())),
                                     encoding="utf-8")
    (out / "bad_input.html").write_text(report.render_html(_bad_input(out)), encoding="utf-8")
    return out, [*names(), "index", "stress", "bad_input"]


def _bad_input(folder) -> dict:
    """A verdict without a culprit: NaN already in the batch (no replay, a leaves table instead)."""
    import torch

    import nanmodels

    torch.manual_seed(3)
    x = torch.randn(6, 4)
    x[2, 1] = float("nan")
    torch.save({"x": x, "y": torch.randint(0, 5, (6,)), "state": nanmodels.classifier().state_dict()},
               folder / "bad_input.pt")
    return analyze(folder / "bad_input.pt", model="nanmodels:classifier", loss="nll_loss").to_json()


def _stress(d: dict) -> dict:
    """A report with everything long: 150 module calls of deep modules, a 200-character line, long names."""
    deep = "encoder.layers.{}.self_attention.output_projection_with_a_long_name"
    d["activations"] = [dict(d["activations"][i % len(d["activations"])], module=deep.format(i)) for i in range(150)]
    code = "d = " + " + ".join(f"torch.sqrt(((anchor_embedding_{i} - positive_embedding_{i}) ** 2).sum(-1))"
                               for i in range(3))
    d["culprit"]["source"]["code"] = code
    d["culprit"]["module"] = deep.format(7)
    d["diagnosis"]["fix"].update(before=code, after=code.replace(".sum(-1))", ".sum(-1) + 1e-10)"))
    for e in d["chain"]:
        e["module"] = deep.format(e["index"])
    d["gradients"] = [dict(d["gradients"][0], name=deep.format(i) + ".weight") for i in range(40)]
    return d


@pytest.mark.parametrize("width", WIDTHS)
def test_nothing_sticks_out_and_the_console_stays_clean(browser, pages, width):
    folder, stems = pages
    trouble = {}
    for stem in stems:
        page = browser.open(folder / f"{stem}.html", width=width)
        try:
            over = page.overflowing()
            problems = page.problems()
            smallest = page.smallest_chart_text()
            cut = page.clipped_chart_text()
        finally:
            page.close()
        if over["scroll"] > over["viewport"] or over["elements"]:
            trouble[stem] = f"{over['scroll']} px wide in a {over['viewport']} px viewport: {over['elements'][:5]}"
        if problems:
            trouble[stem] = problems
        if smallest is not None and smallest < MIN_CHART_FONT:
            trouble[stem] = f"chart text drawn at {smallest:.1f} px"
        if cut:
            trouble[stem] = f"chart text cut at the chart's edge: {cut[:5]}"
        assert stem in ("index", "bad_input") or smallest is not None  # every replayed report has a chart
    assert not trouble, trouble


def test_the_policy_holds_and_the_check_would_see_a_violation(browser, pages, tmp_path):
    folder, _ = pages
    html = (folder / "sqrt_zero.html").read_text()
    bad = tmp_path / "injected.html"
    bad.write_text(html.replace("<h1>", '<img src="https://example.invalid/x.png"><script>document.title="ran"</script>'
                                        '<h1 style="color:red">', 1))
    page = browser.open(bad, width=1280)
    try:
        problems = page.problems()
        title = page.eval("document.title")
    finally:
        page.close()
    assert title != "ran"  # the injected inline script did not run
    assert any("img-src" in p for p in problems) and any("script-src" in p for p in problems), problems


def test_sorting_the_gradient_table_by_shape_sorts_by_size(browser, pages):
    folder, _ = pages
    page = browser.open(folder / "fp16_overflow.html", width=1280)
    try:
        page.eval("document.querySelectorAll('table.grads th')[1].click()")
        first = page.eval("Array.from(document.querySelectorAll('table.grads tbody tr'))"
                          ".map(function (r) { return r.cells[1].textContent; })")
        page.eval("document.querySelectorAll('table.grads th')[1].click()")
        second = page.eval("Array.from(document.querySelectorAll('table.grads tbody tr'))"
                           ".map(function (r) { return r.cells[1].textContent; })")
    finally:
        page.close()

    def size(shape: str) -> int:
        n = 1
        for dim in shape.split("×"):
            n *= int(dim)
        return n

    # by element count, largest first, then smallest first: 64×64 > 64×32 > 64 > 1, not "1" < "64" < "64×32" as text
    assert [size(s) for s in first] == sorted((size(s) for s in first), reverse=True)
    assert [size(s) for s in second] == sorted(size(s) for s in second) and len(set(first)) > 2


def test_printed_pdf_has_every_code_line_whole(browser, pages):
    if shutil.which("pdftotext") is None:
        pytest.skip("pdftotext (poppler-utils) not found on PATH: the print check needs it")
    folder, stems = pages
    clipped = {}
    for stem in stems:
        page = browser.open(folder / f"{stem}.html", width=1280)
        try:
            lines = [ln for block in page.eval(CODE) for ln in block.split("\n") if ln.strip()]
            text = pdf_text(page.pdf())
        finally:
            page.close()
        flat = re.sub(r"\s+", "", text)
        missing = [ln for ln in lines if re.sub(r"\s+", "", ln) not in flat]
        if missing:
            clipped[stem] = missing
        assert stem in ("index", "bad_input") or lines, stem
        assert "Click a header" not in text and "open them" not in text, stem  # screen-only instructions
        if stem == "sqrt_zero":
            assert "aten.neg.default" in text  # a folded run of the chain prints open
    assert not clipped, clipped


# Per code block: the pieces a line broke inside (a piece never may) and how many lines the block took.
# The verdict box's own text, without what print hides (the screen-only parts).
CORE = """
(function () {
  var core = document.querySelector('#verdict .core').cloneNode(true);
  core.querySelectorAll('.screen').forEach(function (e) { e.remove(); });
  return core.textContent;
})()
"""
# What must never be cut mid-word in print: file names, code and options.
INDEX_WORDS = "ul.reports a, table.failures code, table.groups pre, table.groups code, .opt"
REPORT_WORDS = "pre.code, .src .line, .banner .where"


@pytest.mark.parametrize("paper", sorted(PAPER))
def test_printed_verdict_starts_on_page_one_and_is_not_split(browser, pages, paper):
    folder, stems = pages
    trouble = {}
    for stem in stems:
        if stem == "index":
            continue
        page = browser.open(folder / f"{stem}.html", width=1280)
        try:
            core = page.eval(CORE)
            printed = pdf_pages(page.pdf(paper))
        finally:
            page.close()
        flat = re.sub(r"\s+", "", core).lower()  # lower: the verdict label is upper-cased by CSS
        if flat not in re.sub(r"\s+", "", printed[0]).lower():
            first = re.sub(r"\s+", " ", printed[0]).strip()[:120]
            trouble[stem] = f"page 1 of {len(printed)} holds only: {first!r}"
    assert not trouble, trouble


@pytest.mark.parametrize("paper", sorted(PAPER))
def test_printed_file_names_code_and_options_wrap_only_between_words(browser, pages, paper):
    """Laid out for paper: a file name wraps after a '/' or '_', code at a space or separator, never mid-word."""
    folder, stems = pages
    split = {}
    for stem in stems:
        page = browser.open(folder / f"{stem}.html", width=1280)
        try:
            page.emulate_print(paper)
            if stem == "index":
                assert page.eval("document.querySelectorAll('ul.reports a').length") > 0
            words = page.split_words(INDEX_WORDS if stem == "index" else REPORT_WORDS)
        finally:
            page.close()
        if words:
            split[stem] = words[:8]
    assert not split, split


def test_a_number_with_a_minus_never_wraps_at_its_minus_on_a_phone(browser, pages):
    """1e-10 used to break as "1e-" / "10" at 420 px: every such number is drawn on one line."""
    folder, stems = pages
    broken, seen = {}, 0
    for stem in stems:
        page = browser.open(folder / f"{stem}.html", width=420)
        try:
            found = page.eval(r"""
(function () {
  var out = [], walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT), n;
  while ((n = walker.nextNode())) {
    var re = /\d(?:\.\d+)?e-\d+/g, m;
    while ((m = re.exec(n.data))) {
      var r = document.createRange(); r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
      var rects = Array.from(r.getClientRects()).filter(function (x) { return x.width > 0; });
      var tops = rects.map(function (x) { return Math.round(x.top); });
      out.push(new Set(tops).size > 1 ? m[0] : '');
    }
  }
  return out;
})()""")
        finally:
            page.close()
        seen += len(found)
        if any(found):
            broken[stem] = [f for f in found if f]
    assert seen and not broken, broken


# Each argument's first and last character: where a line broke inside one, they lie on different lines.
WORDS_WHOLE = """
Array.from(document.querySelectorAll('pre.code')).map(function (pre) {
  var tops = new Set(), broken = [];
  pre.querySelectorAll('.word').forEach(function (s) {
    var rects = Array.from(s.getClientRects());
    if (rects.length !== 1) { broken.push(s.textContent); }
    rects.forEach(function (r) { tops.add(Math.round(r.top)); });
  });
  return {broken: broken, lines: tops.size};
})
"""


def test_the_reproduce_command_wraps_only_between_its_arguments(browser, pages, tmp_path):
    """Snapshot paths of every length up to two printed lines (with spaces and hyphens, as real paths have)
    bring each option of the command to a line's end once: on screen and on paper the command wraps only
    between arguments (a path also after a "/"), so `--json` never prints as `--` and `json`."""
    wrapped = jinja_env().get_template("code.j2").module.wrapped
    folder, _ = pages
    html = (folder / "zero_norm.html").read_text(encoding="utf-8")
    long = "/srv/a very-long path-name for checking/that nothing-depends/on where the checkout lives/" * 3
    d = {"verdict": "culprit_found", "invocation": {"model": "sample_snapshots.models:triplet", "trust": True,
                                                    "loss": "mse_loss"}}
    commands = [reproduce_view({**d, "snapshot": long[:n].rstrip() + "/zero_norm.pt"}).command for n in range(40, 240)]
    start, end = html.index('<section id="reproduce">'), html.index("</section>", html.index('<section id="reproduce">'))
    blocks = "".join(f'<pre class="code">{wrapped(c)}</pre>\n' for c in commands)
    page_file = tmp_path / "commands.html"
    page_file.write_text(html[:start] + '<section id="reproduce">' + blocks + html[end:], encoding="utf-8")
    for width in WIDTHS:
        page = browser.open(page_file, width=width)
        try:
            seen = page.eval(WORDS_WHOLE)
            text = pdf_text(page.pdf()) if width == WIDTHS[-1] and shutil.which("pdftotext") else None
        finally:
            page.close()
        assert not any(s["broken"] for s in seen), [s["broken"] for s in seen if s["broken"]][:3]
        assert sum(s["lines"] > 1 for s in seen) > len(commands) // 2, "the sweep should wrap most commands"
    if text is None:
        pytest.skip("pdftotext (poppler-utils) not found on PATH: the print half of this check needs it")
    printed = re.sub(r"\s+", "", text).split("nanreplayanalyze")[-len(commands):]
    torn = [c for c, p in zip(commands, printed, strict=True)
            if not p.startswith(re.sub(r"\s+", "", c)[len("nanreplayanalyze"):])]
    assert not torn, torn[:3]
