"""Whole-process cost of `nanreplay analyze` vs a script that just loads the snapshot and runs the step.

    python benchmarks/end_to_end.py [--layers 4] [--batch 16] [--repeats 2]

Both sides are fresh Python processes on the same native snapshot (the
reference transformer with a NaN deep inside, written by NanGuard):

* plain:     import torch, torch.load the snapshot, rebuild the model from its
             code, load the weights, one forward+backward;
* nanreplay: `nanreplay analyze SNAP --json PATH -o REPORT` with all default analyses
             (replay, diagnosis with fix verification, precision probe, report).

Prints wall time and peak RSS for each and their ratios (targets: time <= 3x,
memory <= 1.5x), then where nanreplay's time goes (imports, load, each pass,
rendering). `--layers/--batch` scale the model (see also scaling.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MAKE = """
import sys, warnings, torch
sys.path.insert(0, {root!r})
from benchmarks import transformer as tf
from nanreplay import NanGuard
torch.manual_seed(0)
model = tf.Transformer(layers={layers}, nan_layer={layers} - 2)
idx, y = tf.batch(batch_size={batch})
guard = NanGuard(model, loss_fn=tf.loss_fn, folder={folder!r}, factory="benchmarks.transformer:build_nan")
guard.begin(idx, y)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    assert not guard.loss_ok(tf.loss_fn(model(idx), y))
print(guard.last_snapshot)
"""

PLAIN = """
import resource, sys, time
t0 = time.perf_counter()
import torch
sys.path.insert(0, {root!r})
from benchmarks import transformer as tf
torch.set_num_threads({threads})
d = torch.load({snap!r}, weights_only=True, mmap=True)
torch.manual_seed(0)
model = tf.Transformer(layers={layers}, nan_layer={layers} - 2)
model.load_state_dict({{k: v for k, v in d["state"].items()}})
idx, y = d["batch"]["inputs"], d["batch"]["target"]
loss = tf.loss_fn(model(idx), y)
loss.backward()
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

ANALYZE = """
import resource, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads({threads})
from nanreplay.cli import main
t_import = time.perf_counter() - t0
try:
    main(["analyze", {snap!r}, "--json", {json_path!r}, "-o", {report!r}])
except SystemExit as e:
    assert not e.code, e.code
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, t_import)
"""


def run(code: str, cwd: Path) -> list[float]:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    return [float(v) for v in res.stdout.strip().splitlines()[-1].split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        res = subprocess.run([sys.executable, "-c", MAKE.format(root=str(ROOT), layers=args.layers,
                                                                batch=args.batch, folder=str(tmp))],
                             capture_output=True, text=True, cwd=tmp, timeout=1800)
        if res.returncode:
            raise SystemExit(res.stderr[-3000:])
        snap = res.stdout.strip().splitlines()[-1]
        kw = dict(root=str(ROOT), snap=snap, layers=args.layers, threads=args.threads)
        plain, ana = [], []
        for _ in range(args.repeats):
            plain.append(run(PLAIN.format(**kw), tmp))
            res = run(ANALYZE.format(**kw, json_path=str(tmp / "a.json"), report=str(tmp / "r.html")), tmp)
            ana.append((res, json.loads((tmp / "a.json").read_text())))
        p_t, p_m = min(r[0] for r in plain), min(r[1] for r in plain)
        (a_t, a_m, a_imp), d = min(ana, key=lambda r: r[0][0])  # the fastest run, with its own breakdown
        print(f"reference transformer: {args.layers} layers, d=384, seq 256, batch {args.batch}; "
              f"snapshot {Path(snap).stat().st_size / 1e6:.1f} MB; culprit {d['culprit']['op']} "
              f"in {d['culprit']['module']!r}; fix {d['diagnosis']['fix']['kind']} "
              f"verified={d['diagnosis']['fix']['verified']}")
        print(f"  plain load+step      {p_t:7.2f} s   peak RSS {p_m / 1024:7.0f} MB")
        print(f"  nanreplay analyze    {a_t:7.2f} s   peak RSS {a_m / 1024:7.0f} MB")
        print(f"  ratio                {a_t / p_t:7.2f}x time (target <= 3)   {a_m / p_m:5.2f}x memory (target <= 1.5)")
        t = d["stats"]["timings"]
        print("  where nanreplay's time goes (that run):")
        print(f"    imports (torch + nanreplay)  {a_imp:6.2f} s")
        for k in ("load", "replay", "diagnose", "precision"):
            if k in t:
                print(f"    {k:28s} {t[k]:6.2f} s")
        other = a_t - a_imp - t["total"]
        print(f"    report + JSON + exit         {other:6.2f} s")


if __name__ == "__main__":
    main()
