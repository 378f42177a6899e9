"""NanGuard's cost on healthy training steps, as a fraction of the step time.

    python benchmarks/guard_overhead.py [--steps 20]

Two models: a small MLP (where any fixed cost shows) and the reference
transformer (4 layers, d=384, seq 256, batch 16). Three loops, interleaved:
plain (zero_grad, forward, loss, backward, clip_grad_norm_, step), guarded with
the norm passed in (`guard.grads_ok(norm)`, the recommended form), and guarded
letting the guard compute the norm itself. Target: <= 2% on the transformer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import transformer as tf  # noqa: E402
from nanreplay import NanGuard  # noqa: E402


def mlp_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    return model, x, y, F.cross_entropy


def transformer_setup():
    torch.manual_seed(0)
    model = tf.Transformer()
    idx, y = tf.batch()
    return model, idx, y, tf.loss_fn


def make_loops(model, x, y, loss_fn, folder):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    params = list(model.parameters())
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder)

    def plain():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    def guarded(norm_passed: bool):
        guard.begin(x, y)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        if not guard.loss_ok(loss):
            raise SystemExit("unexpected non-finite loss")
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0) if norm_passed else None
        if not guard.grads_ok(norm):
            raise SystemExit("unexpected non-finite gradient")
        if not norm_passed:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return {"plain": plain, "guard (norm passed)": lambda: guarded(True),
            "guard (norm computed)": lambda: guarded(False)}


def bench(loops: dict, steps: int, inner: int) -> dict:
    times = {k: [] for k in loops}
    for fn in loops.values():
        fn()
    for _ in range(steps):
        for k, fn in loops.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[k].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        for label, setup, inner, steps in (("small MLP", mlp_setup, 20, args.steps),
                                           ("transformer", transformer_setup, 1, max(5, args.steps // 2))):
            t = bench(make_loops(*setup(), folder), steps, inner)
            base = t["plain"]
            print(f"\n{label}: median step time over {steps} rounds")
            for k, v in t.items():
                print(f"  {k:22s} {v * 1e3:9.3f} ms   {100 * (v / base - 1):+6.2f}% vs plain")
        assert not list(Path(folder).iterdir()), "a healthy run must not write snapshots"


if __name__ == "__main__":
    main()
