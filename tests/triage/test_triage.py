"""`nanreplay triage DIR`: grouping, failures as rows, the cache, timeouts, exit codes."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

import nanmodels
from nanreplay import triage
from nanreplay.cli import main


def run(*args):
    return CliRunner().invoke(main, ["triage", *map(str, args)])


class Evil:
    """Unpickling this creates a file: proof that code from the snapshot ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# file -> (branch of nanmodels.ThreeCauses, seed); step and rank come from the names
SNAPSHOTS = {
    "nan_snapshot_step_10_rank0.pt": (0, 1),
    "nan_snapshot_step_10_rank1.pt": (0, 2),
    "nan_snapshot_step_11_rank0.pt": (1, 3),
    "nan_snapshot_step_11_rank1.pt": (2, 4),
    "nan_snapshot_step_12_rank0.pt": (2, 5),
    "other_a.pt": (1, 6),
}
CAUSES = {0: "log_of_zero", 1: "normalize_zero_norm", 2: "sqrt_at_zero"}
MARKERS = {"log_of_zero": "triage_log_zero", "normalize_zero_norm": "triage_zero_norm", "sqrt_at_zero": "triage_sqrt_zero"}
FAILED = {  # file -> category
    "truncated.pt": "unreadable",
    "empty.pt": "unreadable",
    "weights.pt": "unreadable",  # a torch.save file, but not a snapshot
    "evil.pt": "refused",  # torch.save with a pickled object that would run code
    "evil.pkl": "unreadable",  # a plain pickle: not even a torch.save file
}


def _digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "snaps"
    d.mkdir()
    for name, (branch, seed) in SNAPSHOTS.items():
        nanmodels.save_three_causes(branch, d / name, seed)
    shutil.copy(d / "other_a.pt", d / "copy_of_a.pt")  # a duplicate: same bytes, another name
    data = (d / "other_a.pt").read_bytes()
    (d / "truncated.pt").write_bytes(data[: len(data) // 2])
    (d / "empty.pt").write_bytes(b"")
    torch.save({"weights": torch.ones(2)}, d / "weights.pt")
    marker = tmp_path / "pwned"
    torch.save({"x": torch.ones(1, 4), "state": {}, "payload": Evil(str(marker))}, d / "evil.pt")
    (d / "evil.pkl").write_bytes(pickle.dumps({"x": Evil(str(marker))}))
    (d / "notes.txt").write_text("not a snapshot <script>alert(1)</script>")
    return d


def test_triage_groups_lists_failures_and_reuses_its_cache(folder, tmp_path):
    out = tmp_path / "out"
    before = _digest(folder)
    res = run(folder, "-o", out, "--model", "nanmodels:three_causes", "--jobs", "2")
    assert res.exit_code == 1, res.output
    assert not (tmp_path / "pwned").exists()  # the hostile pickles never ran

    doc = json.loads((out / "groups.json").read_text())
    assert doc["schema"] == "nanreplay.triage/1"
    groups = doc["groups"]
    # largest first; equal sizes by first step (log at step 10 before sqrt at step 11)
    assert [(g["cause"], g["count"]) for g in groups] == [
        ("normalize_zero_norm", 3), ("log_of_zero", 2), ("sqrt_at_zero", 2)]
    expect = {c: {f for f, (b, _) in SNAPSHOTS.items() if CAUSES[b] == c} for c in CAUSES.values()}
    expect["normalize_zero_norm"].add("copy_of_a.pt")
    for g in groups:
        assert {s["file"] for s in g["snapshots"]} == expect[g["cause"]]
        # log(relu(...)): softplus where the ReLU makes p, judged against the history (an ε would set the loss)
        assert g["fix"]["verified"] == g["count"]
        assert g["source"]["line"] == nanmodels.CASES.marker_line(MARKERS[g["cause"]])
        for s in g["snapshots"]:
            assert json.loads((out / s["json"]).read_text())["diagnosis"]["cause"] == g["cause"]
            assert (out / s["report"]).is_file()
    sqrt = groups[2]
    assert (sqrt["first_step"], sqrt["last_step"], sqrt["ranks"]) == (11, 12, [0, 1])
    assert sqrt["forward_op"] == "aten.sqrt.default" and sqrt["phase"] == "backward"
    dup = next(s for s in groups[0]["snapshots"] if s["file"] == "other_a.pt")
    assert dup["duplicate_of"] == "copy_of_a.pt"

    assert {f["file"]: f["failure"] for f in doc["failures"]} == FAILED
    reasons = {f["file"]: f["reason"] for f in doc["failures"]}
    assert "truncated" in reasons["truncated.pt"] and "--trust" in reasons["evil.pt"]
    assert all("\n" not in r for r in reasons.values())
    assert doc["ignored"] == ["notes.txt"]

    steps = {s["step"]: s for s in doc["ranks"]["steps"]}
    assert steps[10]["agree"] is True and steps[11]["agree"] is False and steps[12]["agree"] is None
    assert steps[10]["ranks"] == [0, 1] and steps[10]["first_rank"] is None  # seed files carry no write time

    rows = pd.read_csv(out / "summary.csv")
    assert len(rows) == len(SNAPSHOTS) + 1 + len(FAILED)
    assert set(rows.loc[rows.status == "failed", "file"]) == set(FAILED)
    assert rows.loc[rows.file == "nan_snapshot_step_11_rank1.pt", "step"].item() == 11

    html = (out / "index.html").read_text()
    assert "division by a zero norm" in html and "sqrt at zero" in html
    assert 'href="nan_snapshot_step_11_rank1.html"' in html and "truncated.pt" in html
    # escaped and offline: the one script is the report's own table sorter, allowed by hash and nothing else
    from nanreplay.report.html import asset

    assert html.count("<script>") == 1 and f"<script>{asset('report.js')}</script>" in html
    assert "http://" not in html and "https://" not in html and "default-src &#39;none&#39;" in html

    summary = res.stdout.strip().splitlines()[-1]
    assert "12 snapshots, 3 root causes" in summary and "4 unreadable" in summary and "1 refused" in summary
    assert len(res.stderr.strip().splitlines()) == len(FAILED)  # one line per failure
    assert _digest(folder) == before  # inputs untouched, nothing written among them

    # A second run analyzes nothing: every row comes from the cache, no report is rewritten.
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.html") if p.name != "index.html"}
    res2 = run(folder, "-o", out, "--model", "nanmodels:three_causes")
    assert res2.exit_code == 1, res2.output
    assert "(12 from cache)" in res2.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.html") if p.name != "index.html"} == mtimes
    assert json.loads((out / "groups.json").read_text())["groups"] == groups

    # The folder grows: only the new snapshot is analyzed.
    nanmodels.save_three_causes(0, folder / "nan_snapshot_step_13_rank1.pt", 7)
    res3 = run(folder, "-o", out, "--model", "nanmodels:three_causes")
    assert res3.exit_code == 1 and "13 snapshots" in res3.stdout and "(12 from cache)" in res3.stdout
    rows = pd.read_csv(out / "summary.csv")
    assert rows.loc[~rows.cached, "file"].tolist() == ["nan_snapshot_step_13_rank1.pt"]

    # Other options are another cache key; a snapshot that changes is analyzed again.
    assert "from cache" not in run(folder, "-o", out, "--model", "nanmodels:three_causes", "--loss", "l1_loss").stdout


SLEEPY = '''
import os, signal, time
import torch, torch.nn as nn


class Sleepy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if float(x.sum()) > 1000:  # this snapshot hangs
            open("hung.pid", "w").write(str(os.getpid()))
            time.sleep(600)
        if float(x.sum()) < -1000:  # this one kills its worker
            os.kill(os.getpid(), signal.SIGKILL)
        if float(x[0, 0]) == 7.0:  # and this one raises
            raise RuntimeError("boom")
        return torch.log(torch.relu(self.fc(x))).mean()


def build():
    torch.manual_seed(0)
    return Sleepy()
'''


def test_a_hung_replay_is_killed_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --model names a module next to where the command runs
    (tmp_path / "sleepy_model.py").write_text(textwrap.dedent(SLEEPY))
    d = tmp_path / "snaps"
    d.mkdir()
    state = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.zeros(3)}
    torch.manual_seed(1)
    torch.save({"x": torch.full((8, 4), 100.0), "state": state}, d / "a_hangs.pt")
    torch.save({"x": torch.full((8, 4), -100.0), "state": state}, d / "b_crashes.pt")
    torch.save({"x": torch.randn(8, 4), "state": state}, d / "c_ok.pt")
    torch.save({"x": torch.full((8, 4), 7.0), "state": state}, d / "d_raises.pt")
    # One worker: the run can only finish if the hung and the dead worker are both replaced.
    res = run(d, "-o", tmp_path / "out", "--model", "sleepy_model:build", "--jobs", "1", "--timeout", "3")
    assert res.exit_code == 1, res.output
    doc = json.loads((tmp_path / "out" / "groups.json").read_text())
    failures = {f["file"]: f for f in doc["failures"]}
    assert {k: f["failure"] for k, f in failures.items()} == {
        "a_hangs.pt": "timeout", "b_crashes.pt": "crashed", "d_raises.pt": "replay_error"}
    assert "boom" in failures["d_raises.pt"]["reason"] and "SIGKILL" in failures["b_crashes.pt"]["reason"]
    assert [s["file"] for g in doc["groups"] for s in g["snapshots"]] == ["c_ok.pt"]
    pid = int((tmp_path / "hung.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the hung worker is really gone
    assert not list((tmp_path / "out").glob(".*.tmp"))
    # timeouts and crashes are not cached: the next run tries them again
    entries = json.loads((tmp_path / "out" / triage.CACHE_FILE).read_text())["entries"]
    assert set(entries) == {"c_ok.pt", "d_raises.pt"}


def test_recursive_name_collisions_and_missing_model(tmp_path):
    d = tmp_path / "snaps"
    for sub in ("rank0", "rank1"):
        (d / sub).mkdir(parents=True)
        nanmodels.save_three_causes(0, d / sub / "step_5.pt", 1)
    nanmodels.save_three_causes(2, d / "index.pt", 2)  # must not become OUTDIR/index.html
    nanmodels.save_three_causes(2, d / "INDEX.pth", 3)
    (d / "Rank0__step_5.pt").write_bytes((d / "rank0" / "step_5.pt").read_bytes())
    out = d / "triage-out"  # inside DIR: skipped when scanning
    res = run(d, "-o", out, "--recursive", "--model", "nanmodels:three_causes", "-q")
    assert res.exit_code == 0, res.output
    assert res.stderr == ""
    rows = pd.read_csv(out / "summary.csv")
    assert len(rows) == 5 and rows.name.str.casefold().nunique() == 5
    for r in rows.itertuples():
        assert json.loads((out / r.json).read_text())["snapshot"] == str(d / r.file)
    assert "nanreplay triage" in (out / "index.html").read_text()
    res = run(d, "-o", out, "--recursive", "--model", "nanmodels:three_causes")
    assert res.exit_code == 0 and "5 snapshots" in res.stdout and "(5 from cache)" in res.stdout

    # without --model, every seed snapshot is a failed row that says what to do
    res = run(d, "-o", tmp_path / "o2")
    assert res.exit_code == 1
    doc = json.loads((tmp_path / "o2" / "groups.json").read_text())
    assert {f["failure"] for f in doc["failures"]} == {"not_replayable"}
    assert all("--model" in f["reason"] for f in doc["failures"])


@pytest.mark.parametrize("args,needle", [
    (["{tmp}/nope"], "no such folder"),
    (["{tmp}/file.pt"], "not a folder"),
    (["{tmp}", "-o", "{tmp}"], "must not be DIR"),
    (["{tmp}", "-o", "{tmp}/file.pt"], "not a folder"),
    (["{tmp}", "--jobs", "0"], "--jobs"),
    (["{tmp}", "--timeout", "-1"], "--timeout"),
    (["{tmp}", "--model", "nanmodels"], "expected MODULE:NAME"),
])
def test_usage_errors_exit_2(tmp_path, args, needle):
    (tmp_path / "file.pt").write_bytes(b"x")
    res = run(*[a.format(tmp=tmp_path) for a in args])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and "Traceback" not in res.output
    assert not (tmp_path / "index.html").exists()


def test_empty_folder_is_not_an_error(tmp_path):
    (tmp_path / "in").mkdir()
    res = run(tmp_path / "in", "-o", tmp_path / "out")
    assert res.exit_code == 0 and "0 snapshots, 0 root causes" in res.stdout
    assert (tmp_path / "out" / "index.html").is_file()


def _row(file, step, rank, group, created=None, status="analyzed"):
    return {"file": file, "step": step, "rank": rank, "group": group, "created": created, "status": status,
            "report": f"{file}.html", "world_size": 4}


def test_ranks_first_failure_by_step_then_write_time():
    rows = [_row("a", 7, 2, "g1", "2024-05-01T10:00:02"), _row("b", 7, 0, "g1", "2024-05-01T10:00:01"),
            _row("c", 8, 1, None, "2024-05-01T10:01:00", status="failed"), _row("d", 8, 3, "g2", "2024-05-01T10:00:59"),
            _row("e", 3, None, "g1")]  # no rank: not part of the multi-rank view
    r = triage.build_ranks(rows)
    assert [s["step"] for s in r["steps"]] == [7, 8]
    assert (r["first"]["step"], r["first"]["rank"], r["first"]["file"]) == (7, 0, "b")
    s7, s8 = r["steps"]
    assert (s7["first_rank"], s7["ordered_by"], s7["agree"]) == (0, "written first", True)
    assert (s8["first_rank"], s8["agree"], s8["failed_ranks"]) == (3, None, [1])
    assert r["world_size"] == 4
    assert triage.build_ranks([_row("x", None, 0, "g")]) is None


def test_output_names_are_distinct_and_stable():
    rels = ["x.pt", "x.pth", "a/b.pt", "a__b.pt", "index.pt", "we ird<name>.pt", "X.pt"]
    items = [triage.Item(path=r, rel=r) for r in rels]
    triage.assign_names(items)
    names = [it.name for it in items]
    assert len({n.casefold() for n in names}) == len(names)
    assert all(n and not n.startswith(".") and "/" not in n and "<" not in n for n in names)
    assert "index" not in names and names[rels.index("a/b.pt")].startswith("a__b-")
    again = [triage.Item(path=r, rel=r) for r in reversed(rels)]
    triage.assign_names(again)
    assert {it.rel: it.name for it in again} == dict(zip(rels, names, strict=True))


def test_summary_csv_never_holds_a_live_formula():
    import csv
    import io

    from nanreplay.triage import summary_csv

    rows = [{"file": "=HYPERLINK(\"http://x\")", "name": "+cmd", "status": "analyzed", "code": "-1 + x",
             "reason": "@SUM(A1)"}, {"file": "ok.pt", "name": "ok", "status": "analyzed"}]
    parsed = list(csv.DictReader(io.StringIO(summary_csv(rows))))
    assert [parsed[0][k] for k in ("file", "name", "code", "reason")] == \
        ["'=HYPERLINK(\"http://x\")", "'+cmd", "'-1 + x", "'@SUM(A1)"]
    assert parsed[1]["file"] == "ok.pt"
