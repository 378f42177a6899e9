"""index.html and the Markdown summary of a triage run, and `--model` applied only where a snapshot needs it."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser

import pytest
from click.testing import CliRunner

from nanreplay.cli import main
from nanreplay.triage import markdown_summary
from samples import ROOT, SAMPLES, STATE_DICT_SAMPLE


class Tags(HTMLParser):
    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A folder with a native snapshot, a plain state-dict one and a broken file, triaged with --model."""
    tmp = tmp_path_factory.mktemp("mixed")
    d = tmp / "in"
    d.mkdir()
    shutil.copy(SAMPLES / "sqrt_zero.pt", d / "native_step_3.pt")
    shutil.copy(SAMPLES / "log_zero.pt", d / "other_native_step_4.pt")
    shutil.copy(SAMPLES / f"{STATE_DICT_SAMPLE}.pt", d / "plain_step_3.pt")
    (d / "broken_step_9.pt").write_bytes(b"not a snapshot")
    out = tmp / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # --model names a module importable from here, as a user's would be
        res = CliRunner().invoke(main, ["triage", str(d), "-o", str(out), "--model", "sample_snapshots.models:triplet",
                                        "--jobs", "1", "--markdown", str(tmp / "triage.md")])
    return res, out, tmp / "triage.md"


def test_model_applies_only_to_the_snapshots_that_need_it(mixed):
    res, out, _ = mixed
    assert res.exit_code == 1, res.output  # the broken file, and only it
    doc = json.loads((out / "groups.json").read_text())
    assert [f["file"] for f in doc["failures"]] == ["broken_step_9.pt"]
    analyzed = {s["file"]: s for g in doc["groups"] for s in g["snapshots"]}
    assert set(analyzed) == {"native_step_3.pt", "other_native_step_4.pt", "plain_step_3.pt"}
    inv = {f: json.loads((out / s["json"]).read_text())["invocation"]["model"] for f, s in analyzed.items()}
    assert inv == {"native_step_3.pt": None, "other_native_step_4.pt": None,
                   "plain_step_3.pt": "sample_snapshots.models:triplet"}


def test_index_is_a_compact_sortable_table_with_a_policy(mixed):
    _, out, _ = mixed
    html = (out / "index.html").read_text()
    tags = Tags(html).tags
    metas = {a.get("name") or a.get("http-equiv"): a.get("content") for t, a in tags if t == "meta"}
    assert metas["viewport"] == "width=device-width, initial-scale=1"
    assert metas["Content-Security-Policy"].startswith("default-src 'none'") and "script-src 'sha256-" in metas[
        "Content-Security-Policy"]
    doc = json.loads((out / "groups.json").read_text())
    (table,) = [a for t, a in tags if t == "table" and "groups" in a.get("class", "")]
    assert "sortable" in table["class"]
    rows = [a for t, a in tags if t == "tr" and a.get("id", "").startswith("g")]
    assert [r["id"] for r in rows] == [g["id"] for g in doc["groups"]]  # one row per group, no cards
    assert not [a for t, a in tags if t == "div" and a.get("class") == "group"]
    assert 'href="#failures">1 unreadable</a>' in html and 'id="failures"' in html  # the count links to the table
    assert "bf16_or_grad_scaler" not in html and ">add an epsilon <" in html  # fixes in words
    assert [a["data-cause"] for a in rows] == [g["cause"] for g in doc["groups"]]  # identifiers stay as data


def test_each_report_links_back_to_the_index(mixed):
    _, out, _ = mixed
    doc = json.loads((out / "groups.json").read_text())
    for g in doc["groups"]:
        for s in g["snapshots"]:
            html = (out / s["report"]).read_text()
            assert re.search(r'<a class="index" href="index.html">« index</a>', html)


def test_markdown_summary_of_the_run(mixed):
    _, out, md_path = mixed
    md = md_path.read_text()
    doc = json.loads((out / "groups.json").read_text())
    assert md == markdown_summary(doc)
    table = [ln for ln in md.splitlines() if re.match(r"^\| \d+ \|", ln)]
    assert len(table) == len(doc["groups"])
    assert "**Not analyzed (1):**" in md and "`broken_step_9.pt`" in md
    assert md.splitlines()[0].startswith("**nanreplay triage**") and "3 snapshots" not in md  # 4 files in all
    assert "4 snapshots" in md.splitlines()[0]
