"""NanGuard's cost on healthy training steps, as a fraction of the step time.

    python benchmarks/guard_overhead.py [--steps 20]

Two models: a small MLP (where any fixed cost shows) and the reference
transformer (4 layers, d=384, seq 256, batch 16). Four loops, interleaved:
plain (zero_grad, forward, loss, backward, clip_grad_norm_, step), guarded with
the norm passed in (`guard.grads_ok(norm)`, the recommended form), the same
without the update check (`check_update=False`), and guarded letting the guard
compute the norm itself. Target: <= 2% on the transformer.

The update check alone (the optimizer step hooks: one fused norm of the weights
and one host sync after every step) is also timed by itself, N calls in a row,
as a fraction of the plain step: target <= 0.5% on the transformer.
`--update-check-only` measures just that (a few plain steps and the hooks).
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
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-5)  # no hooks on this one
    unchecked = NanGuard(model, opt2, loss_fn=loss_fn, folder=folder, check_update=False)

    def plain():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    def guarded(norm_passed: bool, guard=guard, opt=opt):
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
            "guard, no update check": lambda: guarded(True, unchecked, opt2),
            "guard (norm computed)": lambda: guarded(False)}


def update_check_cost(setup, calls: int, steps: int) -> tuple[float, float]:
    """(seconds per plain step, seconds per update check): the check timed by itself, `calls` in a row."""
    model, x, y, loss_fn = setup()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as folder:
        guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder)
        watch = guard._watch
        watch._before(opt, (), {})
        watch._after(opt, (), {})  # warm: the parameter lists are cached
        t0 = time.perf_counter()
        for _ in range(calls):
            watch._before(opt, (), {})
            watch._after(opt, (), {})
        check = (time.perf_counter() - t0) / calls
        guard.close()
    return statistics.median(times[1:]), check


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
    ap.add_argument("--update-check-only", action="store_true", help="time only the update check (quick)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for label, setup in (("small MLP", mlp_setup), ("transformer", transformer_setup)):
        step, check = update_check_cost(setup, calls=50, steps=3)
        print(f"{label}: update check {check * 1e3:.3f} ms per step = {100 * check / step:.3f}% of a plain step "
              f"({step * 1e3:.1f} ms)")
    if args.update_check_only:
        return
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
