"""The Markdown summary (`--markdown PATH|-`): short, complete, and inert whatever the snapshot holds."""

from __future__ import annotations

import copy
import json
import re

import pytest
from click.testing import CliRunner

from nanreplay import report
from nanreplay.analysis import analyze
from nanreplay.cli import main
from nanreplay.report.markdown import block, code, escape
from samples import SAMPLES
from tolerance import same_text

_cache: dict[str, dict] = {}


def sample(name: str) -> dict:
    if name not in _cache:
        _cache[name] = analyze(SAMPLES / f"{name}.pt").to_json()
    return copy.deepcopy(_cache[name])


def fenced_blocks(md: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block, fences of any length matched like CommonMark does."""
    out, lines, i = [], md.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2)
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^`{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        out.append((info, "\n".join(body)))
        i += 1
    return out


def test_cli_writes_the_summary_to_stdout_and_the_terminal_summary_to_stderr(tmp_path):
    res = CliRunner().invoke(main, ["analyze", str(SAMPLES / "sqrt_zero.pt"), "-o", str(tmp_path / "r.html"),
                                    "--markdown", "-", "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    md = res.stdout
    d = json.loads((tmp_path / "r.json").read_text())  # the same analysis (confined: no local file under the cwd)
    c, fix = d["culprit"], d["diagnosis"]["fix"]
    assert md.startswith("**nanreplay: culprit found** — sqrt at zero: infinite gradient")
    blocks = dict(fenced_blocks(md))
    assert blocks["python"] == c["source"]["code"]  # the culprit's line, with its code
    assert blocks["diff"].splitlines() == [f"- {fix['before']}", f"+ {fix['after']}"]  # the fix as a diff
    for needle in (f"`{c['source']['file']}:{c['source']['line']}`", "**Why:**", "✓ verified by replay",
                   "**Anomaly detection:**", "PowBackward0", "*Environment*", "captured: torch", "replayed: torch"):
        assert needle in md, needle
    assert len(md.splitlines()) <= 25 and len(md) < 2500  # short enough to paste into an issue
    assert "culprit found" in res.stderr and "culprit found" not in md.split("\n", 1)[1]
    assert (tmp_path / "r.html").is_file()


def test_cli_writes_the_summary_to_a_file_and_refuses_two_stdouts(tmp_path):
    out = tmp_path / "summary.md"
    res = CliRunner().invoke(main, ["analyze", str(SAMPLES / "log_zero.pt"), "-o", str(tmp_path / "r.html"),
                                    "--markdown", str(out), "--json", "-"])
    assert res.exit_code == 0, res.output
    assert out.read_text() == report.markdown_summary(json.loads(res.stdout))
    res = CliRunner().invoke(main, ["analyze", str(SAMPLES / "log_zero.pt"), "--markdown", "-", "--json", "-"])
    assert res.exit_code == 2 and "both write to stdout" in res.stderr


def test_snapshot_strings_cannot_format_link_or_break_out_of_code():
    d = sample("sqrt_zero")
    evil_code = "x = 1  # ```\n</details><script>alert(1)</script> [click](http://evil) @everyone"
    d["culprit"]["source"].update(code=evil_code, file="a`b<img src=x>.py", function="f`")
    d["culprit"]["module"] = "mod[evil](http://x)"
    d["failure"]["name"] = "w*<b>bold</b>*_"
    d["diagnosis"]["fix"].update(before="y = 1\n```", after="y = 2 ````")
    md = report.markdown_summary(d)
    blocks = fenced_blocks(md)
    assert [b[0] for b in blocks] == ["python", "diff"]  # no fence closed early, none opened by the snapshot
    assert "</details><script>" in blocks[0][1] and "[click](http://evil)" in blocks[0][1]  # inside code: inert
    outside = re.sub(r"(?ms)^(`{3,}).*?^\1`*$", "", md)  # what is not code: no markup survives there
    outside = re.sub(r"(`+).+?\1", "", outside)
    assert "<script>" not in outside and "<b>" not in outside and "<img" not in outside and "](http" not in outside
    assert "`` mod[evil](http://x) ``" in md or "`mod[evil](http://x)`" in md  # module names are code spans
    assert "w\\*\\<b\\>bold\\</b\\>\\*\\_" in md


def test_the_helpers():
    assert code("a`b") == "``a`b``" and code("`x") == "`` `x ``"
    assert block("```\nx", "py").startswith("````py\n") and block("x").endswith("\n```")
    assert escape("a_b *c* [d](e) <f> @g | h") == "a\\_b \\*c\\* \\[d\\](e) \\<f\\> \\@g \\| h"
    assert escape("line\nbreak\x1b[31m") == "line break\\[31m"


@pytest.mark.parametrize("verdict_case", ["nonfinite_input", "not_reproduced"])
def test_verdicts_without_a_culprit(verdict_case, tmp_path):
    d = sample("log_zero")
    d.update(verdict=verdict_case, culprit=None, chain=[], failure=None)
    if verdict_case == "nonfinite_input":
        d["nonfinite_leaves"] = [{"name": "x[`0`]", "role": "input", "nan": 2, "inf": 0, "shape": [4]}]
    md = report.markdown_summary(d)
    assert md.count("\n") < 20 and "```python" not in md.split("**Fix**")[0]
    if verdict_case == "nonfinite_input":
        assert "NaN/Inf was already in the input batch" in md and "``x[`0`]``" in md


def test_the_docs_show_what_the_command_prints(monkeypatch):
    """docs/analyze.md's Markdown sample is the summary of sample_snapshots/sqrt_zero.pt (the environment line aside),
    analyzed as docs/analyze.md says: from the repository root."""
    import linecache

    from samples import ROOT

    monkeypatch.chdir(ROOT)
    # (lines are cached by path, and paths are shown relative to the current folder)
    linecache.checkcache()  # ... and lines are cached by those (relative) paths
    doc = (ROOT / "docs" / "analyze.md").read_text()
    shown = doc.split("````markdown\n", 1)[1].split("\n````", 1)[0]
    actual = report.markdown_summary(analyze("sample_snapshots/sqrt_zero.pt", source=["."])).rstrip("\n")

    def body(md: str) -> list[str]:
        return [ln for ln in md.splitlines() if not ln.startswith("*Environment*")]

    # its numbers (the loss) are computed: another machine may round their last digit shown the other way
    assert len(body(shown)) == len(body(actual)) and all(map(same_text, body(shown), body(actual))), \
        (body(shown), body(actual))
    assert (ROOT / "docs" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the screenshot it shows
