"""`nanreplay triage` with hostile or damaged input (issue 14): one bad file is one row, OUTDIR is locked and
never loses another run's reports, big files are hashed by the workers, failure lines reach the terminal escaped."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

import nanmodels
from nanreplay import triage
from nanreplay.triage.cache import CACHE_FILE
from nanreplay.triage.lock import OutdirLock
from nanreplay.triage.rows import Item, make_row
from nanreplay.triage.worker import analysis_fields

MODEL = "nanmodels:three_causes"
plan_mod = importlib.import_module("nanreplay.triage.plan")  # the package's `plan` is the function


def run(*args):
    return CliRunner().invoke(main_cli(), ["triage", *map(str, args)])


def main_cli():
    from nanreplay.cli import main

    return main


def _digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".nanreplay-lock"}


def _folder(d: Path, n: int = 3) -> Path:
    d.mkdir()
    for i in range(n):
        nanmodels.save_three_causes(i % 3, d / f"snap_{i}.pt", i + 1)
    return d


# ---------------------------------------------------------------- one bad file is one row


BAD_FIELDS = {"step": "twelve", "rank": 1.5, "world_size": 10 ** 30, "created": 5}


def test_rows_of_any_type_become_a_summary_and_an_index(tmp_path):
    """Whatever a snapshot's fields hold (a string step, a float rank, a number too big for Int64), the row
    takes them as empty and every output is written."""
    d = {"verdict": "culprit_found", "snapshot_info": BAD_FIELDS,
         "culprit": {"op": ["not", "text"], "module": {"a": 1}, "source": {"file": "m.py", "line": "7", "code": 3}},
         "diagnosis": {"cause": 7, "fix": {"verified": "yes"}}}
    out = tmp_path / "out"
    out.mkdir()
    items = [Item(path=f"in/{n}.pt", rel=f"{n}.pt", name=n) for n in ("a", "b")]
    for it in items:
        it.row = make_row(it, analysis_fields(d))
    p = triage.Plan(dir=tmp_path / "in", outdir=out, options=triage.Options(), items=items, ignored=[], old_cache={})
    res = triage.write(p)
    rows = pd.read_csv(out / "summary.csv")
    assert len(rows) == 2 and rows["step"].isna().all() and rows["rank"].isna().all()
    assert rows["world_size"].isna().all() and rows["source_line"].isna().all()
    assert rows["op"].tolist() == ["['not', 'text']"] * 2 and res.groups[0]["count"] == 2
    assert (out / "index.html").is_file() and json.loads((out / "groups.json").read_text())["groups"]


def _native_snapshot(folder: Path) -> Path:
    return nanmodels.CASES["log_zero"].native_snapshot(folder)


def test_native_snapshots_with_wrong_typed_step_and_rank_are_one_row_each(tmp_path):
    src = _native_snapshot(tmp_path / "guard")
    d = tmp_path / "snaps"
    d.mkdir()
    base = torch.load(src, weights_only=True)
    for name, fields in {"string_step": {"step": "twelve"}, "float_step": {"step": 12.5},
                         "huge_step": {"step": 10 ** 30}, "float_rank": {"rank": 0.5, "world_size": "2"}}.items():
        torch.save({**base, **fields}, d / f"{name}.pt")
    out = tmp_path / "out"
    for _ in range(2):  # the second run reads every row from the cache: nothing poisoned there either
        res = run(d, "-o", out, "--no-verify", "-j", "2")
        assert res.exit_code in (0, 1), res.output
        assert "Traceback" not in res.output
        rows = pd.read_csv(out / "summary.csv")
        assert sorted(rows.file) == ["float_rank.pt", "float_step.pt", "huge_step.pt", "string_step.pt"]
        rows = rows.set_index("file")
        # the native format's schema refuses each file: one failed row naming the field, nothing poisoned
        assert (rows.status == "failed").all() and rows.step.isna().all() and (out / "index.html").is_file()
        assert "step must be an integer" in rows.loc["string_step.pt", "reason"]
        assert "rank must be an integer" in rows.loc["float_rank.pt", "reason"]
    assert "(4 from cache)" in res.stdout


def test_a_poisoned_cache_row_does_not_break_the_next_run(tmp_path):
    d = _folder(tmp_path / "snaps", 2)
    out = tmp_path / "out"
    assert run(d, "-o", out, "--model", MODEL, "--no-verify").exit_code == 0
    cache = json.loads((out / CACHE_FILE).read_text())
    for e in cache["entries"].values():
        e["row"].update(step="x", rank=2.5, source_line=10 ** 40, seconds="slow", fix_verified="maybe", status=3)
    (out / CACHE_FILE).write_text(json.dumps(cache))
    res = run(d, "-o", out, "--model", MODEL, "--no-verify")
    assert res.exit_code in (0, 1) and "Traceback" not in res.output, res.output
    rows = pd.read_csv(out / "summary.csv")
    assert len(rows) == 2 and rows.step.isna().all() and (out / "index.html").is_file()


# ---------------------------------------------------------------- OUTDIR: locked, another run's reports kept


def test_a_busy_outdir_is_one_line(tmp_path):
    d = _folder(tmp_path / "snaps", 1)
    out = tmp_path / "out"
    out.mkdir()
    lock = OutdirLock(out).acquire()
    try:
        res = run(d, "-o", out, "--model", MODEL)
        assert res.exit_code == 2, res.output
        err = res.stderr.strip()
        assert len(err.splitlines()) == 1 and "another nanreplay triage" in err and "pid" in err
        assert not (out / "index.html").exists()
    finally:
        lock.release()
    assert run(d, "-o", out, "--model", MODEL, "--no-verify").exit_code == 0


def test_a_second_dir_into_the_same_outdir_deletes_nothing(tmp_path):
    first = _folder(tmp_path / "a", 2)
    second = tmp_path / "b"
    second.mkdir()
    nanmodels.save_three_causes(2, second / "other.pt", 9)
    out = tmp_path / "out"
    assert run(first, "-o", out, "--model", MODEL, "--no-verify").exit_code == 0
    before = _digest(out)
    assert {"snap_0.html", "snap_1.html", "index.html"} <= set(before)
    res = run(second, "-o", out, "--model", MODEL, "--no-verify")
    assert res.exit_code == 2 and "holds the triage of another folder" in res.stderr, res.output
    assert _digest(out) == before
    # the same DIR again is fine, and a snapshot that left DIR takes only its own reports with it
    (first / "snap_1.pt").unlink()
    assert run(first, "-o", out, "--model", MODEL, "--no-verify").exit_code == 0
    assert (out / "snap_0.html").exists() and not (out / "snap_1.html").exists()


# ---------------------------------------------------------------- hashing: big files in the workers


def test_big_files_are_hashed_by_their_worker(tmp_path, monkeypatch):
    d = _folder(tmp_path / "snaps", 2)
    (d / "copy.pt").write_bytes((d / "snap_0.pt").read_bytes())
    monkeypatch.setattr(plan_mod, "HASH_IN_PARENT", 0)  # every file counts as big
    parent_hashed = []
    real = plan_mod.sha256_file
    monkeypatch.setattr(plan_mod, "sha256_file", lambda p: parent_hashed.append(p) or real(p))
    out = tmp_path / "out"
    res = run(d, "-o", out, "--model", MODEL, "--no-verify")
    assert res.exit_code == 0, res.output
    assert parent_hashed == []
    rows = pd.read_csv(out / "summary.csv").set_index("file")
    assert rows.loc["copy.pt", "sha256"] == hashlib.sha256((d / "copy.pt").read_bytes()).hexdigest()
    assert rows.loc["snap_0.pt", "duplicate_of"] == "copy.pt"
    res = run(d, "-o", out, "--model", MODEL, "--no-verify")  # hashes known now: all from the cache
    assert "(3 from cache)" in res.stdout and parent_hashed == []


def test_a_huge_sparse_file_does_not_stall_the_run(tmp_path, monkeypatch):
    d = _folder(tmp_path / "snaps", 1)
    with open(d / "huge.pt", "wb") as f:
        f.write(b"PK\x03\x04")
        f.truncate(20 << 30)  # 20 GiB, sparse: reading it all would take about a minute
    real = plan_mod.sha256_file

    def no_huge(p):
        assert not p.endswith("huge.pt"), "the parent must not read the huge file"
        return real(p)

    monkeypatch.setattr(plan_mod, "sha256_file", no_huge)
    t0 = time.monotonic()
    res = run(d, "-o", tmp_path / "out", "--model", MODEL, "--no-verify", "--max-memory", "1G")
    assert res.exit_code == 1, res.output
    assert time.monotonic() - t0 < 60
    doc = json.loads((tmp_path / "out" / "groups.json").read_text())
    (f,) = doc["failures"]
    assert f["file"] == "huge.pt" and f["failure"] == "over_limit" and "--max-memory" in f["reason"]
    assert "1 over the memory limit" in res.stdout
    entries = json.loads((tmp_path / "out" / CACHE_FILE).read_text())["entries"]
    assert "huge.pt" not in entries  # a refusal for size depends on the limit: never cached


# ---------------------------------------------------------------- the per-failure lines


def test_failure_lines_are_escaped_one_per_file(tmp_path):
    d = tmp_path / "snaps"
    d.mkdir()
    (d / "bad\x1b]52;c;cHduZWQ=\x07\nnanreplay: all fine.pt").write_bytes(b"PK\x03\x04 garbage")
    (d / "rtl\u202eexe.pt").write_bytes(b"\x80\x02 garbage")
    res = run(d, "-o", tmp_path / "out")
    assert res.exit_code == 1, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 2 and all(ln.startswith("nanreplay: ") for ln in err)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c == "\u202e" for c in res.output if c != "\n")
    assert "\\nnanreplay: all fine.pt" in res.stderr and "\\u202e" in res.stderr
    html = (tmp_path / "out" / "index.html").read_text()
    assert "\u202e" not in html and "[U+202E]" in html
    csv_rows = pd.read_csv(io.StringIO((tmp_path / "out" / "summary.csv").read_text()))
    assert len(csv_rows) == 2


@pytest.mark.parametrize("size", ["0", "lots", "-5M"])
def test_bad_max_memory_is_a_usage_error(tmp_path, size):
    res = run(tmp_path, "-o", tmp_path / "out", "--max-memory", size)
    assert res.exit_code == 2 and "--max-memory" in res.stderr and "Traceback" not in res.output


def test_a_link_out_of_the_folder_is_neither_hashed_nor_opened(tmp_path):
    """A stranger's archive may hold `leak.pt -> ~/secret`: triage lists it as not followed (its hash would be
    written in the index, its bytes handed to the analysis); a link inside the folder is followed as before."""
    d, outside = tmp_path / "archive", tmp_path / "home"
    (d / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.pt").write_bytes(b"private")
    (d / "sub" / "real.pt").write_bytes(b"not a snapshot either")
    (d / "leak.pt").symlink_to(outside / "secret.pt")
    (d / "alias.pt").symlink_to(d / "sub" / "real.pt")
    snaps, other = plan_mod.discover(d, tmp_path / "out", recursive=True)
    assert snaps == ["alias.pt", "sub/real.pt"]
    assert other == ["leak.pt (a link to a file outside the folder: not followed)"]
