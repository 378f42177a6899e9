"""The flow triggers' per-step cost against the norm the guard takes anyway, paired, as a share of a plain step.

    python benchmarks/flow_overhead.py [--rounds 30] [--inner 20]

On the reference transformer (benchmarks/transformer.py) and a small MLP, after one backward (real gradients):
A = `total_norm` (the guard's norm without check_flow), B = `FlowWatch(vanish=None).measure` (the dead-gradient
counts), C = `FlowWatch().measure` (the same plus the vanishing watch). A, B and C alternate in every round
(`inner` calls each; the order reversed every other round), so the machine's load hits them alike; a plain
training step is timed in the same rounds. Prints the medians and the quartiles over the rounds of (C - A) (paired
within a round) over the median step. Times are the process's CPU time (`time.process_time`): on a shared machine
the wall clock mostly measures the other processes. Target: <= 1%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import transformer as tf  # noqa: E402
from benchmarks.guard_overhead import mlp_setup  # noqa: E402
from nanreplay.capture import modelstate as ms  # noqa: E402
from nanreplay.capture.flow import FlowWatch  # noqa: E402


def transformer_setup():
    torch.manual_seed(0)
    model = tf.Transformer()
    idx, y = tf.batch()
    return model, idx, y, tf.loss_fn


def run(label: str, setup, rounds: int, inner: int) -> None:
    model, x, y, loss_fn = setup()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    dead, full = FlowWatch(vanish=None), FlowWatch()
    calls = {"total_norm": lambda: ms.total_norm(model),
             "flow (dead only)": lambda s=[0]: dead.measure(model, opt, s.__setitem__(0, s[0] + 1) or s[0], True),
             "flow + vanish": lambda s=[0]: full.measure(model, opt, s.__setitem__(0, s[0] + 1) or s[0], True)}

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    step()
    for fn in calls.values():
        for _ in range(40):  # past the vanishing watch's warm-up
            fn()
    times: dict[str, list[float]] = {k: [] for k in [*calls, "step"]}
    for r in range(rounds):
        t0 = time.process_time()
        step()
        times["step"].append(time.process_time() - t0)
        for k, fn in (list(calls.items()) if r % 2 else list(calls.items())[::-1]):  # (order alternates too)
            t0 = time.process_time()
            for _ in range(inner):
                fn()
            times[k].append((time.process_time() - t0) / inner)
    med = {k: statistics.median(v) for k, v in times.items()}
    step_med = med["step"]  # (one step per round is too noisy a divisor on a shared machine)
    extra = sorted((c - a) / step_med * 100 for c, a in zip(times["flow + vanish"], times["total_norm"], strict=True))
    old = sorted((c - a) / step_med * 100 for c, a in zip(times["flow (dead only)"], times["total_norm"], strict=True))
    q = lambda v: (v[len(v) // 4], v[len(v) // 2], v[3 * len(v) // 4])  # noqa: E731
    print(f"{label}: step {med['step'] * 1e3:.1f} ms; per call: " +
          ", ".join(f"{k} {med[k] * 1e6:.0f} us" for k in calls))
    print(f"  (flow + vanish - total_norm) / step: quartiles {', '.join(f'{v:.2f}%' for v in q(extra))}; "
          f"(flow dead only - total_norm) / step: {', '.join(f'{v:.2f}%' for v in q(old))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--models", nargs="*", default=["mlp", "transformer"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    for label, setup in (("small MLP", mlp_setup), ("transformer", transformer_setup)):
        if label.split()[-1].lower() in args.models:
            run(label, setup, args.rounds, args.inner)


if __name__ == "__main__":
    main()
