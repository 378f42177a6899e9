"""Whole-process cost of `nanreplay analyze` vs a script that just loads the snapshot and runs the step.

    python benchmarks/end_to_end.py [--rounds 3] [--cases loss,grads,plain,tiny] [--threads 1]

Each case is timed in fresh Python processes, side by side, for `--rounds` paired rounds:

* plain:     import torch, torch.load the snapshot, build the model from its code, load the weights,
             one forward+backward (the issue's baseline);
* training:  the same plus the optimizer the run used and its step — what a training process does (torch's
             Optimizer imports torch._dynamo, as any Python dispatch mode does: see below);
* nanreplay: `nanreplay analyze SNAP --json PATH -o REPORT` with every default analysis (replay, diagnosis
             with fix verification, precision probe, report), confined as users run it; the `plain` case names
             its model and loss (`--model`/`--loss`), so it runs in this process, as users run it.

Cases: `loss` — the reference transformer (4 layers, d=384, seq 256, batch 16), NaN from p*log(p) deep
inside, a native snapshot written by NanGuard in a real loop (two healthy SGD steps, then the bad one);
`grads` — the same model with a finite loss and a NaN gradient (sqrt of a zero distance); `plain` — the seed's
plain `{'x', 'y', 'state'}` dict of the same transformer whose head returns log(softmax(logits)) with grown
weights (a finite loss, NaN gradients), analyzed with `--model benchmarks.transformer:build_log_head --loss
benchmarks.transformer:nll`; `tiny` — a one-layer d=32 transformer at batch 2, where only fixed costs show.

Every ratio is of CPU time (user + system of the finished process and the children it waited for: the OS's own
accounting, as model_scale.py takes it) and of peak RSS, pair by pair; wall times are printed beside them (a
shared machine stretches them). Prints the median ratio of each round's pair with its spread against each
target, met or NOT met, the time to the culprit (CPU from process start to the culprit known, against the whole
plain process) where the analysis runs in this process (`plain`), and where nanreplay's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {  # name: (Transformer kwargs, batch); "plain" builds its model with build_log_head (kwargs unused)
    "loss": ({"layers": 4, "nan_layer": 2}, 16),
    "grads": ({"layers": 4, "grad_layer": 2}, 16),
    "plain": ({}, 16),
    "tiny": ({"layers": 1, "d": 32, "heads": 2, "nan_layer": 0}, 2),
}
MODEL, LOSS = "benchmarks.transformer:build_log_head", "benchmarks.transformer:nll"  # the plain case's flags

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

MAKE_PLAIN = """
import sys, torch
sys.path.insert(0, {root!r})
from benchmarks import transformer as tf
path = {folder!r} + "/nan_snapshot_step_3.pt"
torch.save(tf.log_head_snapshot({batch}), path)  # the seed's cheap NaN insurance: {{'x', 'y', 'state'}}
print(path)
"""

PLAIN = """
import json, sys
import torch
sys.path.insert(0, {root!r})
from benchmarks import transformer as tf
torch.set_num_threads({threads})
d = torch.load({snap!r}, weights_only=True, mmap=True)
torch.manual_seed(0)
if {plain_dict}:  # the seed's dict: the user's factory and loss
    model, loss_fn, (idx, y) = tf.build_log_head(), tf.nll, (d["x"], d["y"])
else:
    model, loss_fn, (idx, y) = tf.Transformer(**{kw!r}), tf.loss_fn, (d["batch"]["inputs"], d["batch"]["target"])
model.load_state_dict(dict(d["state"]))  # (the faulty block on: the step as it failed)
if {training}:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
loss = loss_fn(model(idx), y)
loss.backward()
if {training}:
    opt.step()
print(json.dumps({{}}))
"""

# The analysis runs in a confined child (nanreplay/confine/): its threads come from OMP_NUM_THREADS, its peak
# memory is the child's (RUSAGE_CHILDREN), and this process imports no torch (the CLI renders from the JSON).
ANALYZE = """
import json, resource, sys
cpu = lambda: (lambda r: r.ru_utime + r.ru_stime)(resource.getrusage(resource.RUSAGE_SELF))
from nanreplay import cli
t_import = cpu()
marks = {{}}
if {flags!r}:  # --model: the analysis runs in this process; the culprit's moment is the "culprit" stage
    real = cli._analyze_here
    def here(*a, progress=None, **k):
        def tell(stage, result):
            if stage == "culprit":
                marks.setdefault("culprit", cpu())
            if progress is not None:
                progress(stage, result)
        return real(*a, progress=tell, **k)
    cli._analyze_here = here
try:
    cli.main(["analyze", {snap!r}, "--json", {json_path!r}, "-o", {report!r}, *{flags!r}])
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps({{"imports": t_import, **marks}}))
"""

TIME_TARGET = 2.0  # x the plain process, every case (CPU time)
RSS_TARGET = 1.3  # x the plain process, every case
CULPRIT_TARGET = 1.2  # CPU to the culprit known vs the whole plain process (the in-process case)
FIXED_MB_TARGET = 60  # a tiny model: no fixed overhead of this size


def run(code: str, cwd: Path, threads: int) -> dict:
    """`code` in a fresh process: its JSON line, with the process's CPU time (its waited-for children included),
    wall time and peak RSS (MB) from the OS's accounting of the finished process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-c", code], stdout=so, stderr=se, cwd=cwd, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        so.seek(0)
        se.seek(0)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(se.read()[-3000:])
        out = json.loads(so.read().strip().splitlines()[-1])
    return {**out, "cpu": ru.ru_utime + ru.ru_stime, "wall": wall, "rss": ru.ru_maxrss / 1024}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x (spread {min(values):.2f}-{max(values):.2f}, n={len(values)})"


def verdict(value: float, target: float) -> str:
    return f"target <= {target:g}: {'met' if value <= target else 'NOT met'}"


def measure(name: str, folder: Path, rounds: int, threads: int) -> dict:
    """Write the snapshot, then `rounds` paired rounds of plain / training / analyze."""
    kw, batch = CASES[name]
    folder.mkdir(parents=True, exist_ok=True)
    make = (MAKE_PLAIN if name == "plain" else MAKE).format(root=str(ROOT), kw=kw, batch=batch, folder=str(folder))
    res = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True, cwd=folder.parent,
                         timeout=1800, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    snap = res.stdout.strip().splitlines()[-1]
    flags = ["--model", MODEL, "--loss", LOSS] if name == "plain" else []
    common = dict(root=str(ROOT), snap=snap, kw=kw, threads=threads, plain_dict=name == "plain")
    rows = []
    for _ in range(rounds):  # paired: each round runs all three back to back
        plain = run(PLAIN.format(**common, training=False), folder, threads)
        train = run(PLAIN.format(**common, training=True), folder, threads)
        out = run(ANALYZE.format(snap=snap, flags=flags, json_path=str(folder / "a.json"),
                                 report=str(folder / "r.html")), folder, threads)
        rows.append({"plain": plain, "train": train, "ana": out, "json": json.loads((folder / "a.json").read_text())})
    return {"snap": snap, "rows": rows}


def report(name: str, m: dict) -> dict:
    rows = m["rows"]
    t_ratio = [r["ana"]["cpu"] / r["plain"]["cpu"] for r in rows]
    m_ratio = [r["ana"]["rss"] / r["plain"]["rss"] for r in rows]
    t_train = [r["ana"]["cpu"] / r["train"]["cpu"] for r in rows]
    w_ratio = [r["ana"]["wall"] / r["plain"]["wall"] for r in rows]
    ttc = [r["ana"]["culprit"] / r["plain"]["cpu"] for r in rows if "culprit" in r["ana"]]
    mid = sorted(rows, key=lambda r: r["ana"]["cpu"])[len(rows) // 2]
    d = mid["json"]
    c, fix = d.get("culprit") or {}, (d.get("diagnosis") or {}).get("fix") or {}
    kw, batch = CASES[name]
    what = "plain {'x', 'y', 'state'} dict, --model/--loss" if name == "plain" else f"transformer {kw}"
    print(f"\n[{name}] {what}, batch {batch}; snapshot {Path(m['snap']).stat().st_size / 1e6:.1f} MB; "
          f"failure {d['failure']['what'] if d.get('failure') else '-'}; culprit {c.get('op')} in "
          f"{c.get('module')!r}; fix {fix.get('kind')} verified={fix.get('verified')}; model {d['model']['how']}")
    med = lambda k, f: statistics.median(r[k][f] for r in rows)  # noqa: E731
    for label, k in (("plain load + forward+backward", "plain"), ("+ optimizer and its step", "train"),
                     ("nanreplay analyze", "ana")):
        print(f"  {label:32s} {med(k, 'cpu'):6.2f} s CPU  {med(k, 'wall'):6.2f} s wall  peak RSS {med(k, 'rss'):6.0f} MB")
    print(f"  CPU    vs plain {spread(t_ratio)}; vs a training step {spread(t_train)}; wall vs plain {spread(w_ratio)}")
    print(f"  memory vs plain {spread(m_ratio)}")
    if ttc:
        print(f"  time to the culprit {spread(ttc)} (CPU from process start to the culprit known, vs the plain process)")
    t = d["stats"]["timings"]
    parts = [("imports (the CLI's, CPU)", mid["ana"]["imports"])] + [(k, t[k]) for k in
                                                                    ("load", "replay", "diagnose", "precision") if k in t]
    print("  where nanreplay's time goes (median run; passes in wall seconds): "
          + ", ".join(f"{k} {v:.2f} s" for k, v in parts))
    return {"time": t_ratio, "rss": m_ratio, "ttc": ttc,
            "fixed_mb": med("ana", "rss") - med("plain", "rss"), "fixed_train_mb": med("ana", "rss") - med("train", "rss")}


def installed_bytecode() -> None:
    """Both sides' modules as an installed package has them: compiled to bytecode (pip compiles a wheel's at install;
    an editable install's analysis compiles nanreplay's before its child starts). Where PYTHONDONTWRITEBYTECODE is
    set, as on this project's machines, nothing else would write them, and every process, the analysis's confined
    child above all, would compile its modules from source: a cost no installed copy pays."""
    import compileall

    for folder in ("nanreplay", "benchmarks"):
        compileall.compile_dir(ROOT / folder, quiet=1, workers=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cases", default="loss,grads,plain,tiny")
    args = ap.parse_args()
    installed_bytecode()
    names = [n for n in args.cases.split(",") if n]
    if unknown := [n for n in names if n not in CASES]:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        got = {n: report(n, measure(n, Path(tmp) / n, args.rounds, args.threads)) for n in names}
    print("\ntargets (CPU time and peak RSS, paired rounds)")
    for n in ("loss", "grads", "plain"):
        if n in got:
            g = got[n]
            print(f"  whole process, {n:5s}: {spread(g['time'])}  {verdict(statistics.median(g['time']), TIME_TARGET)}")
            print(f"  peak RSS,      {n:5s}: {spread(g['rss'])}  {verdict(statistics.median(g['rss']), RSS_TARGET)}")
            if g["ttc"]:
                print(f"  to the culprit, {n:5s}: {spread(g['ttc'])}  "
                      f"{verdict(statistics.median(g['ttc']), CULPRIT_TARGET)}")
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
