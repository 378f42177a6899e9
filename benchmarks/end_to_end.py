"""Whole-process cost of `nanreplay analyze` vs a script that just loads the snapshot and runs the step.

    python benchmarks/end_to_end.py [--rounds 3] [--cases loss,grads,tiny]

Each case is a native snapshot written by NanGuard in a real loop (two healthy SGD steps, then the bad
one) and timed in fresh Python processes, side by side, for `--rounds` paired rounds:

* plain:     import torch, torch.load the snapshot, build the model from its code, load the weights,
             one forward+backward (the issue's baseline);
* training:  the same plus the optimizer the run used and its step — what a training process does (torch's
             Optimizer imports torch._dynamo, as any Python dispatch mode does: see below);
* nanreplay: `nanreplay analyze SNAP --json PATH -o REPORT` with every default analysis (replay, diagnosis
             with fix verification, precision probe, report).

Cases: `loss` — the reference transformer (4 layers, d=384, seq 256, batch 16), NaN from p*log(p) deep
inside; `grads` — the same model with a finite loss and a NaN gradient (sqrt of a zero distance);
`tiny` — a one-layer d=32 transformer at batch 2, where only fixed costs show.

Prints the median ratio of each round's pair with its spread, against each target, met or not, and where
nanreplay's time goes in the median run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {  # name: (Transformer kwargs, batch)
    "loss": ({"layers": 4, "nan_layer": 2}, 16),
    "grads": ({"layers": 4, "grad_layer": 2}, 16),
    "tiny": ({"layers": 1, "d": 32, "heads": 2, "nan_layer": 0}, 2),
}

MAKE = """
import sys, warnings, torch
sys.path.insert(0, {root!r})
from benchmarks import transformer as tf
from nanreplay import NanGuard
torch.manual_seed(0)
model = tf.Transformer(**{kw!r})
bad = [b for b in model.blocks if b.nan or b.grad_nan][0]
fault = "nan" if bad.nan else "grad_nan"
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
guard = NanGuard(model, opt, loss_fn=tf.loss_fn, folder={folder!r})
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for step in range(3):  # two healthy steps (the history a real run has), then the bad one
        setattr(bad, fault, step == 2)
        idx, y = tf.batch(batch_size={batch}, seed=step)
        guard.begin(idx, y, step=step)
        if not guard.step(tf.loss_fn(model(idx), y)):
            break
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
model = tf.Transformer(**{kw!r})  # the faulty block on: the step as it failed
model.load_state_dict(dict(d["state"]))
if {training}:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
idx, y = d["batch"]["inputs"], d["batch"]["target"]
loss = tf.loss_fn(model(idx), y)
loss.backward()
if {training}:
    opt.step()
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

# The analysis runs in a confined child (nanreplay/confine/): its threads come from OMP_NUM_THREADS, its peak
# memory is the child's (RUSAGE_CHILDREN), and this process imports no torch (the CLI renders from the JSON).
ANALYZE = """
import os, resource, sys, time
t0 = time.perf_counter()
os.environ["OMP_NUM_THREADS"] = "{threads}"
from nanreplay.cli import main
t_import = time.perf_counter() - t0
try:
    main(["analyze", {snap!r}, "--json", {json_path!r}, "-o", {report!r}])
except SystemExit as e:
    assert not e.code, e.code
peak = max(resource.getrusage(r).ru_maxrss for r in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print(time.perf_counter() - t0, peak, t_import)
"""

TIME_TARGET = 2.0  # x the plain process, reference transformer, loss failure
RSS_TARGET = 1.3  # x the plain process, loss and gradient failures
FIXED_MB_TARGET = 60  # a tiny model: no fixed overhead of this size


def run(code: str, cwd: Path) -> list[float]:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    return [float(v) for v in res.stdout.strip().splitlines()[-1].split()]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x (spread {min(values):.2f}-{max(values):.2f})"


def verdict(value: float, target: float) -> str:
    return f"target <= {target:g}: {'met' if value <= target else 'NOT met'}"


def measure(kw: dict, batch: int, folder: Path, rounds: int, threads: int) -> dict:
    """Write the snapshot (a NanGuard loop), then `rounds` paired rounds of plain / training / analyze."""
    res = subprocess.run([sys.executable, "-c", MAKE.format(root=str(ROOT), kw=kw, batch=batch, folder=str(folder))],
                         capture_output=True, text=True, cwd=folder.parent, timeout=1800)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    snap = res.stdout.strip().splitlines()[-1]
    common = dict(root=str(ROOT), snap=snap, kw=kw, threads=threads)
    rows = []
    for _ in range(rounds):  # paired: each round runs all three back to back
        plain = run(PLAIN.format(**common, training=False), folder)
        train = run(PLAIN.format(**common, training=True), folder)
        out = run(ANALYZE.format(**common, json_path=str(folder / "a.json"), report=str(folder / "r.html")), folder)
        rows.append({"plain": plain, "train": train, "ana": out, "json": json.loads((folder / "a.json").read_text())})
    return {"snap": snap, "rows": rows}


def report(name: str, m: dict) -> dict:
    rows = m["rows"]
    t_ratio = [r["ana"][0] / r["plain"][0] for r in rows]
    m_ratio = [r["ana"][1] / r["plain"][1] for r in rows]
    t_train = [r["ana"][0] / r["train"][0] for r in rows]
    m_train = [r["ana"][1] / r["train"][1] for r in rows]
    mid = sorted(rows, key=lambda r: r["ana"][0])[len(rows) // 2]
    d = mid["json"]
    c, fix = d.get("culprit") or {}, (d.get("diagnosis") or {}).get("fix") or {}
    kw, batch = CASES[name]
    print(f"\n[{name}] transformer {kw}, batch {batch}; snapshot {Path(m['snap']).stat().st_size / 1e6:.1f} MB; "
          f"failure {d['failure']['what'] if d.get('failure') else '-'}; culprit {c.get('op')} in "
          f"{c.get('module')!r}; fix {fix.get('kind')} verified={fix.get('verified')}")
    med = lambda k, i: statistics.median(r[k][i] for r in rows)  # noqa: E731
    print(f"  plain load + forward+backward   {med('plain', 0):6.2f} s   peak RSS {med('plain', 1) / 1024:6.0f} MB")
    print(f"  + optimizer and its step        {med('train', 0):6.2f} s   peak RSS {med('train', 1) / 1024:6.0f} MB")
    print(f"  nanreplay analyze               {med('ana', 0):6.2f} s   peak RSS {med('ana', 1) / 1024:6.0f} MB")
    print(f"  time   vs plain {spread(t_ratio)}; vs a training step {spread(t_train)}")
    print(f"  memory vs plain {spread(m_ratio)}; vs a training step {spread(m_train)}")
    t = d["stats"]["timings"]
    parts = [("imports (the CLI's)", mid["ana"][2])] + [(k, t[k]) for k in
                                                               ("load", "replay", "diagnose", "precision") if k in t]
    parts.append(("the child's start and torch import + report + JSON + exit", mid["ana"][0] - mid["ana"][2] - t["total"]))
    print("  where nanreplay's time goes (median run): " + ", ".join(f"{k} {v:.2f} s" for k, v in parts))
    return {"time": statistics.median(t_ratio), "rss": statistics.median(m_ratio),
            "fixed_mb": (med("ana", 1) - med("plain", 1)) / 1024, "fixed_train_mb": (med("ana", 1) - med("train", 1)) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default="loss,grads,tiny")
    args = ap.parse_args()
    names = [n for n in args.cases.split(",") if n]
    if unknown := [n for n in names if n not in CASES]:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        got = {n: report(n, measure(*CASES[n], Path(tmp) / n, args.rounds, args.threads)) for n in names}
    print("\ntargets")
    if "loss" in got:
        print(f"  end to end, reference transformer, loss failure: {got['loss']['time']:.2f}x  "
              f"{verdict(got['loss']['time'], TIME_TARGET)}")
    for n in ("loss", "grads"):
        if n in got:
            print(f"  peak RSS, {n} failure: {got[n]['rss']:.2f}x  {verdict(got[n]['rss'], RSS_TARGET)}")
    if "tiny" in got:
        f = got["tiny"]
        print(f"  fixed memory on a tiny model: +{f['fixed_mb']:.0f} MB vs forward+backward, "
              f"+{f['fixed_train_mb']:.0f} MB vs a training step  "
              f"{'met' if f['fixed_mb'] < FIXED_MB_TARGET else 'NOT met'} (target: no {FIXED_MB_TARGET}+ MB)")
    print("  (fixed costs: torch imports torch._dynamo, ~1.1 s and ~70 MB, the first time any Python dispatch mode or\n"
          "   Python meta kernel runs — the replay's instrumentation and the snapshot's meta dry run; a training\n"
          "   process pays it too, when it builds a torch.optim optimizer)")


if __name__ == "__main__":
    main()
