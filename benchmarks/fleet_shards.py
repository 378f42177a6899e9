"""`nanreplay triage` in one process vs split into parts (`--shard I/N`, run one after another) and merged.

    python benchmarks/fleet_shards.py [--snapshots 200] [--parts 4] [--jobs 2]

Builds N small snapshots of three root causes (triage_throughput.py's model), triages the folder from scratch
with the `nanreplay` command once whole and once as --parts parts, each part a fresh command as a Slurm array task
or a Kubernetes indexed Job would run it, then `--merge`. Checks that the merged groups, counts, failures and
rank table are those of the single run, and prints the wall times: the single run, each part, their sum, the merge.
On a cluster the parts run at once, on as many machines: the wall time is then the slowest part plus the merge.

    python benchmarks/fleet_shards.py --merge-only 10000 [--parts 4]

The merge alone at fleet scale: N synthetic result rows (20 root causes, 50 hosts with 8 devices each, machine
verdicts, ranks) written as the parts' part.json, then `nanreplay triage --merge` in a fresh process: its wall time
and peak memory (no snapshot is analyzed: a row is what a part leaves behind).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from triage_throughput import make_snapshots  # noqa: E402


def nanreplay(*args: str) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "nanreplay.cli", "triage", *args], env=env, capture_output=True,
                       text=True)
    took = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        sys.exit(f"nanreplay triage {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return took


def comparable(doc: dict) -> dict:
    groups = [{**{k: v for k, v in g.items() if k != "snapshots"},
               "files": [(s["file"], s["duplicate_of"]) for s in g["snapshots"]]} for g in doc["groups"]]
    return {"groups": groups, "counts": doc["counts"], "failures": doc["failures"],
            "ranks_first": (doc["ranks"] or {}).get("first"), "machines": doc["machines"]}


def synthetic_parts(out: Path, n: int, parts: int) -> None:
    from nanreplay.triage.rows import COLUMNS
    from nanreplay.triage.shard import PART_FILE, PART_SCHEMA, in_shard, part_folder

    causes = ["log_of_zero", "normalize_zero_norm", "sqrt_at_zero", "fp16_overflow", "exp_overflow"]
    by_part: dict[int, list[dict]] = {i: [] for i in range(parts)}
    for k in range(n):
        c = k % 20
        host = f"host-{k % 50:02d}"
        row = dict.fromkeys(COLUMNS)
        row.update(file=f"run-{k % 37}/nan_step{k:06d}_rank{k % 64}.pt", name=f"run-{k % 37}__nan_step{k:06d}",
                   status="analyzed", verdict="bug", cause=causes[c % 5], title=f"cause {c}",
                   op="aten.log.default", forward_op=f"aten.op{c}.default", backward_node=None, phase="forward",
                   kind="nan", module=f"blocks.{c}.attn", source=f"model.py:{100 + c}", source_path="model.py",
                   source_line=100 + c, code=f"y = op{c}(x)", fix_kind="clamp", fix_code="x.clamp_min(1e-6)",
                   fix_verified=True, step=1000 + k // 64, rank=k % 64, world_size=64,
                   created=f"2026-12-0{1 + k % 6}T10:00:{k % 60:02d}Z", format="native", trigger="loss",
                   sha256=f"{k:064x}", report=f"x{k}.html", json=f"x{k}.json", cached=False, seconds=1.0,
                   machine_verdict="transient" if (k % 50 == 7 and k % 8 == 3) else "reproducible", host=host,
                   device=f"cuda:{k % 8}", run=f"run-{k % 37}")
        by_part[next(i for i in range(parts) if in_shard(row["file"], i, parts))].append({**row, "_folder": False})
    for i, rows in by_part.items():
        f = part_folder(out, i, parts)
        f.mkdir(parents=True)
        (f / PART_FILE).write_text(json.dumps({"schema": PART_SCHEMA, "part": i, "of": parts, "dir": "/fleet",
                                               "options": {}, "ignored": [], "rows": rows}))


def merge_only(n: int, parts: int) -> None:
    code = ("import resource, sys, time; from nanreplay.triage.merge import merge; t = time.perf_counter(); "
            "r = merge(sys.argv[1]); t = time.perf_counter() - t; "
            "print(t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, len(r.groups), r.counts['snapshots'], "
            "(r.doc['machines'] or {}).get('transient'))")
    with tempfile.TemporaryDirectory() as tmp:
        synthetic_parts(Path(tmp), n, parts)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", code, tmp], env=env, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        sizes = {f.name: f.stat().st_size for f in Path(tmp).iterdir() if f.is_file()}
    took, rss_kb, groups, rows, transient = r.stdout.split()
    print(f"merge of {rows} rows in {parts} parts: {float(took):.1f} s in merge(), {wall:.1f} s with the process "
          f"start; peak memory {int(rss_kb) / 1024:.0f} MiB; {groups} groups, {transient} transient incidents; "
          f"index.html {sizes['index.html'] / 1e6:.1f} MB, groups.json {sizes['groups.json'] / 1e6:.1f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshots", type=int, default=200)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ray", action="store_true", help="also: one run with --ray (a local Ray cluster of --jobs CPUs)")
    ap.add_argument("--merge-only", type=int, metavar="ROWS", help="time the merge alone on ROWS synthetic rows")
    args = ap.parse_args()
    if args.merge_only:
        merge_only(args.merge_only, args.parts)
        return
    common = ["--model", "triage_throughput:build", "--no-verify", "--jobs", str(args.jobs), "--timeout", "300"]
    with tempfile.TemporaryDirectory() as tmp:
        snaps, one, split = Path(tmp, "snaps"), Path(tmp, "one"), Path(tmp, "split")
        snaps.mkdir()
        make_snapshots(snaps, args.snapshots)
        t_one = nanreplay(str(snaps), "-o", str(one), *common)
        t_parts = [nanreplay(str(snaps), "-o", str(split), *common, "--shard", f"{i}/{args.parts}")
                   for i in range(args.parts)]
        t_merge = nanreplay("--merge", str(split))
        t_ray = nanreplay(str(snaps), "-o", str(Path(tmp, "ray")), *common, "--ray") if args.ray else None
        a = json.loads((one / "groups.json").read_text())
        b = json.loads((split / "groups.json").read_text())
        c = json.loads(Path(tmp, "ray", "groups.json").read_text()) if args.ray else a
        sizes = [len(json.loads((split / "parts" / f"part-{i}-of-{args.parts}" / "part.json").read_text())["rows"])
                 for i in range(args.parts)]
    same = comparable(a) == comparable(b) == comparable(c)
    print(f"{args.snapshots} snapshots, {a['counts']['groups']} groups, --jobs {args.jobs}, --no-verify")
    print(f"one process:          {t_one:7.1f} s")
    print(f"{args.parts} parts in turn:      {sum(t_parts):7.1f} s  (each: "
          + ", ".join(f"{t:.1f} s/{n}" for t, n in zip(t_parts, sizes, strict=True)) + ")")
    print(f"merge:                {t_merge:7.1f} s")
    print(f"parts at once + merge:{max(t_parts) + t_merge:7.1f} s  (on {args.parts} machines)")
    if t_ray is not None:
        print(f"--ray, {args.jobs} CPUs:       {t_ray:7.1f} s  (a local Ray cluster started by the command)")
    print(f"same groups, counts, failures, machines: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
