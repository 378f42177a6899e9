"""How the culprit-finding replay scales with model size and batch size.

    python benchmarks/scaling.py [--repeats 3]

For three model widths (at batch 8) and three batch sizes (at the reference
width), with a NaN planted deep inside, measures in one process: a plain
forward+backward, nanreplay's instrumented replay, and the peak memory each
allocates (torch's CPU allocator is not visible to tracemalloc, so memory is
read as the growth of the process's peak RSS in a fresh subprocess per point).
The cost must grow linearly with the work: the replay/plain ratio should stay
flat across sizes, and time per sample flat across batch sizes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

POINT = """
import resource, sys, time, torch
sys.path.insert(0, {root!r})
torch.set_num_threads({threads})
from benchmarks import transformer as tf
from nanreplay import replay
torch.manual_seed(0)
model = tf.Transformer(layers=4, d={d}, heads={heads}, nan_layer=2)
idx, y = tf.batch(batch_size={batch})
names = {{id(m): n for n, m in model.named_modules()}}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
def plain():
    model.zero_grad(set_to_none=True)
    tf.loss_fn(model(idx), y).backward()
def scan():
    replay.run(model, lambda: model(idx), lambda o: tf.loss_fn(o, y), names=names)
fn = {{"plain": plain, "scan": scan}}["{which}"]
fn()
best = float("inf")
for _ in range({repeats}):
    t0 = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t0)
print(best, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""


def point(which: str, d: int, heads: int, batch: int, repeats: int, threads: int) -> tuple[float, float]:
    code = POINT.format(root=str(ROOT), d=d, heads=heads, batch=batch, which=which, repeats=repeats,
                        threads=threads)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if res.returncode:
        raise SystemExit(res.stderr[-2000:])
    t, mem = res.stdout.split()[-2:]
    return float(t), float(mem) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rows = [("width", d, h, 8) for d, h in ((128, 2), (256, 4), (384, 6))]
    rows += [("batch", 384, 6, b) for b in (4, 8, 16)]
    print(f"{'sweep':6s} {'d':>4s} {'batch':>5s} {'plain s':>8s} {'replay s':>9s} {'ratio':>6s} "
          f"{'plain MB':>9s} {'replay MB':>10s} {'mem ratio':>9s} {'replay ms/sample':>17s}")
    for sweep, d, h, b in rows:
        pt, pm = point("plain", d, h, b, args.repeats, args.threads)
        st, sm = point("scan", d, h, b, args.repeats, args.threads)
        print(f"{sweep:6s} {d:4d} {b:5d} {pt:8.3f} {st:9.3f} {st / pt:6.2f} {pm:9.0f} {sm:10.0f} "
              f"{sm / max(pm, 1):9.2f} {1e3 * st / b:17.1f}")


if __name__ == "__main__":
    main()
