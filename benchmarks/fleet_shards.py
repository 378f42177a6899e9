"""`nanreplay triage` in one process vs split into parts (`--shard I/N`, run one after another) and merged.

    python benchmarks/fleet_shards.py [--snapshots 200] [--parts 4] [--jobs 2]

Builds N small snapshots of three root causes (triage_throughput.py's model), triages the folder from scratch
with the `nanreplay` command once whole and once as --parts parts, each part a fresh command as a Slurm array task
or a Kubernetes indexed Job would run it, then `--merge`. Checks that the merged groups, counts, failures and
rank table are those of the single run, and prints the wall times: the single run, each part, their sum, the merge.
On a cluster the parts run at once, on as many machines: the wall time is then the slowest part plus the merge.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshots", type=int, default=200)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    common = ["--model", "triage_throughput:build", "--no-verify", "--jobs", str(args.jobs), "--timeout", "300"]
    with tempfile.TemporaryDirectory() as tmp:
        snaps, one, split = Path(tmp, "snaps"), Path(tmp, "one"), Path(tmp, "split")
        snaps.mkdir()
        make_snapshots(snaps, args.snapshots)
        t_one = nanreplay(str(snaps), "-o", str(one), *common)
        t_parts = [nanreplay(str(snaps), "-o", str(split), *common, "--shard", f"{i}/{args.parts}")
                   for i in range(args.parts)]
        t_merge = nanreplay("--merge", str(split))
        a = json.loads((one / "groups.json").read_text())
        b = json.loads((split / "groups.json").read_text())
        sizes = [len(json.loads((split / "parts" / f"part-{i}-of-{args.parts}" / "part.json").read_text())["rows"])
                 for i in range(args.parts)]
    same = comparable(a) == comparable(b)
    print(f"{args.snapshots} snapshots, {a['counts']['groups']} groups, --jobs {args.jobs}, --no-verify")
    print(f"one process:          {t_one:7.1f} s")
    print(f"{args.parts} parts in turn:      {sum(t_parts):7.1f} s  (each: "
          + ", ".join(f"{t:.1f} s/{n}" for t, n in zip(t_parts, sizes, strict=True)) + ")")
    print(f"merge:                {t_merge:7.1f} s")
    print(f"parts at once + merge:{max(t_parts) + t_merge:7.1f} s  (on {args.parts} machines)")
    print(f"same groups, counts, failures, machines: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
