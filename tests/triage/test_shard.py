"""`nanreplay triage DIR --shard I/N` and `--merge OUTDIR`: the parts joined say what one run over DIR says."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from click.testing import CliRunner

import nanmodels
from nanreplay.cli import main
from nanreplay.triage import shard
from nanreplay.triage.machines import build_machines
from nanreplay.triage.merge import merge

MODEL = ("--model", "nanmodels:three_causes", "--no-verify", "--jobs", "1")


def run(*args):
    return CliRunner().invoke(main, ["triage", *map(str, args)])


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "snaps"
    d.mkdir()
    for k in range(6):  # two of each root cause
        nanmodels.save_three_causes(k % 3, d / f"nan_snapshot_step_{10 + k}_rank{k % 2}.pt", k + 1)
    shutil.copy(d / "nan_snapshot_step_10_rank0.pt", d / "a_copy.pt")  # a duplicate, most likely in another part
    (d / "broken.pt").write_bytes(b"not a snapshot")
    (d / "notes.txt").write_text("not a snapshot either")
    return d


def _same(doc: dict) -> dict:
    """groups.json without where the reports live (the merged index links into the parts)."""
    groups = [{**{k: v for k, v in g.items() if k != "snapshots"},
               "snapshots": [{k: v for k, v in s.items() if k not in ("report", "json")} for s in g["snapshots"]]}
              for g in doc["groups"]]
    ranks = json.loads(json.dumps(doc["ranks"]))
    for step in ranks["steps"]:
        for e in step["entries"]:
            e.pop("report")
    return {"groups": groups, "ranks": ranks, "counts": doc["counts"], "failures": doc["failures"],
            "ignored": doc["ignored"], "summary": doc["summary"]}


def test_three_parts_merged_say_what_one_run_says(folder, tmp_path):
    one, out = tmp_path / "one", tmp_path / "sharded"
    assert run(folder, "-o", one, *MODEL).exit_code == 1  # broken.pt fails: exit 1, as always
    parts = {i: {r.rel for r in _listing(folder) if shard.in_shard(r.rel, i, 3)} for i in range(3)}
    assert sorted(f for p in parts.values() for f in p) == sorted(r.rel for r in _listing(folder))  # each once

    last = max(parts, key=lambda i: len(parts[i]))  # held back: the merge names it missing
    for i in sorted(set(parts) - {last}):
        res = run(folder, "-o", out, *MODEL, "--shard", f"{i}/3")
        assert res.exit_code in (0, 1), res.output
    res = run("--merge", out)
    assert res.exit_code == 1 and f"parts missing: {last} of 3" in res.output and f"--array={last}" in res.output
    partial = json.loads((out / "groups.json").read_text())
    assert partial["parts"] == {"of": 3, "present": sorted(set(parts) - {last}), "missing": [last]}
    assert partial["counts"]["snapshots"] == sum(len(parts[i]) for i in parts if i != last)
    assert f"1 of 3 parts missing: {last}" in partial["summary"]

    res = run(folder, "-o", out, *MODEL, "--shard", f"{last}/3")
    assert res.exit_code in (0, 1), res.output
    res = run("--merge", out)
    assert res.exit_code == 1, res.output  # broken.pt: one failure, no part missing
    assert "parts missing" not in res.output and "merged 3 of 3 parts" in res.output
    merged, single = json.loads((out / "groups.json").read_text()), json.loads((one / "groups.json").read_text())
    assert merged["parts"]["missing"] == []
    assert _same(merged) == _same(single)
    assert [(g["cause"], g["count"]) for g in merged["groups"]] == [
        ("log_of_zero", 3), ("normalize_zero_norm", 2), ("sqrt_at_zero", 2)]
    dup = next(s for g in merged["groups"] for s in g["snapshots"] if s["file"] == "nan_snapshot_step_10_rank0.pt")
    assert dup["duplicate_of"] == "a_copy.pt"  # found across parts, as one run finds it
    # the merged index links into the parts, where each part wrote its reports
    html = (out / "index.html").read_text()
    for g in merged["groups"]:
        for s in g["snapshots"]:
            assert s["report"].startswith("parts/part-") and (out / s["report"]).is_file()
            assert f'href="{s["report"]}"' in html
    csv_one, csv_merged = pd.read_csv(one / "summary.csv"), pd.read_csv(out / "summary.csv")
    assert list(csv_merged["file"]) == list(csv_one["file"])
    assert list(csv_merged["group"].fillna("")) == list(csv_one["group"].fillna(""))

    # a part run again reuses its cache: nothing re-analyzed
    res = run(folder, "-o", out, *MODEL, "--shard", f"{last}/3")
    assert f"({len(parts[last])} from cache)" in res.output  # broken.pt's failure too: it is not one to retry
    doc = json.loads((out / "parts" / f"part-{last}-of-3" / "part.json").read_text())
    assert {r["file"] for r in doc["rows"]} == parts[last]


def _listing(folder):
    from nanreplay.triage.plan import discover
    from nanreplay.triage.rows import Item

    rels, _ = discover(folder, folder / "nowhere", recursive=False)
    return [Item(path=str(folder / r), rel=r) for r in rels]


def test_machine_counts_are_over_every_part(tmp_path):
    """The per-host/device transient counts of the merge are those of all rows together."""
    rows = []
    for k in range(12):
        rows.append({"file": f"r{k}.pt", "name": f"r{k}", "status": "analyzed", "verdict": "bug", "cause": "c",
                     "machine_verdict": "transient" if k % 3 else "reproducible", "host": f"host-{k % 2}",
                     "device": "cuda:0", "run": f"run-{k % 4}", "rank": k % 4, "sha256": f"{k:064x}",
                     "report": f"r{k}.html", "json": f"r{k}.json", "cached": False})
    for i in range(2):
        part = shard.part_folder(tmp_path, i, 2)
        part.mkdir(parents=True)
        doc = {"schema": shard.PART_SCHEMA, "part": i, "of": 2, "dir": "/d", "options": {}, "ignored": [],
               "rows": [{**r, "_folder": False} for r in rows if shard.in_shard(r["file"], i, 2)]}
        (part / shard.PART_FILE).write_text(json.dumps(doc))
    result = merge(str(tmp_path))
    expect = build_machines([{**r, "report": next(m["report"] for m in result.rows if m["file"] == r["file"])}
                             for r in sorted(rows, key=lambda r: r["file"])])  # in the listing's order
    assert result.doc["machines"] == expect and expect["transient"] == 8
    assert {d["host"]: d["transient"] for d in expect["devices"]} == {"host-0": 4, "host-1": 4}


@pytest.mark.parametrize("args,needle", [
    (("--shard", "3/3"), "I counts from 0"),
    (("--shard", "1/0"), "N must be between"),
    (("--shard", "x"), "expected I/N"),
])
def test_bad_shard_is_one_line(folder, tmp_path, args, needle):
    res = run(folder, "-o", tmp_path / "o", *args)
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output


def test_merge_usage_errors(folder, tmp_path):
    res = run("--merge", tmp_path / "nothing")
    assert res.exit_code == 2 and "no such folder" in res.output
    (tmp_path / "empty").mkdir()
    res = run("--merge", tmp_path / "empty")
    assert res.exit_code == 2 and "no parts to merge" in res.output
    res = run(folder, "--merge", tmp_path / "empty")
    assert res.exit_code == 2 and "takes no DIR" in res.output
    res = run()
    assert res.exit_code == 2 and "missing DIR" in res.output
    for n in (2, 3):  # parts of two different splits: which is current is not guessed
        p = shard.part_folder(tmp_path / "mixed", 0, n)
        p.mkdir(parents=True)
        (p / shard.PART_FILE).write_text(json.dumps({"schema": shard.PART_SCHEMA, "rows": []}))
    res = run("--merge", tmp_path / "mixed")
    assert res.exit_code == 2 and "different splits" in res.output
