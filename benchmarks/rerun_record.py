"""What the re-run record (capture/rerun.py, #31.3) costs the guard when it writes a snapshot.

    nice python benchmarks/rerun_record.py [--reps 3]

The reference transformer (4 layers, d=384, seq 256, batch 16), a failing step of each kind the record treats
differently: a NaN loss (the record reads the re-run's loss: no extra pass) and a NaN gradient (it also runs the
re-run's backward, `torch.autograd.grad`, and hashes both sets of gradients). For each, `guard.to_dict(trigger)` —
everything a snapshot costs except the write — with the record and with its work taken out (the random-op watch,
the gradient summaries and the re-run's backward replaced by no-ops), paired A B A B; medians. Healthy steps pay
nothing: all of it happens only when a snapshot is written.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import transformer as T  # noqa: E402
from nanreplay import NanGuard  # noqa: E402
from nanreplay.capture import rerun  # noqa: E402


def _failing_guard(kind: str, folder: str):
    torch.manual_seed(0)
    model = T.Transformer(nan_layer=T.LAYERS - 2) if kind == "loss" else T.Transformer(grad_layer=T.LAYERS - 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    idx, tgt = T.batch()
    guard = NanGuard(model, opt, loss_fn=T.loss_fn, folder=folder, max_snapshots=0)  # to_dict only: no write
    guard.begin(idx, tgt, step=1)
    opt.zero_grad()
    loss = T.loss_fn(model(idx), tgt)
    ok = guard.loss_ok(loss)
    if kind == "gradient":
        assert ok, "the gradient case's loss should be finite"
        loss.backward()
        assert not guard.grads_ok()
    else:
        assert not ok
    return guard


class _Off:
    """The record's work taken out, for the comparison."""

    def __enter__(self):
        self.saved = (rerun.RandomWatch.see, rerun.grads_summary, rerun.record)
        rerun.RandomWatch.see = lambda self, *a: None
        rerun.grads_summary = lambda grads: {}
        rerun.record = lambda **kw: {}
        return self

    def __exit__(self, *exc):
        rerun.RandomWatch.see, rerun.grads_summary, rerun.record = self.saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        for kind, trigger in (("loss", "loss"), ("gradient", "gradient")):
            guard = _failing_guard(kind, tmp)
            guard.to_dict(trigger)  # warm-up
            on, off = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                d = guard.to_dict(trigger)
                on.append(time.perf_counter() - t0)
                with _Off():
                    t0 = time.perf_counter()
                    guard.to_dict(trigger)
                    off.append(time.perf_counter() - t0)
            a, b = statistics.median(on), statistics.median(off)
            print(f"{kind:9} to_dict with the record {a:.3f} s, without {b:.3f} s: +{a - b:.3f} s "
                  f"({a / b:.3f}x); the record's own clock: {d['rerun']['seconds']:.3f} s (includes the re-run "
                  f"itself, which recording the program makes anyway); verdict inputs: training loss "
                  f"{d['rerun']['training'].get('loss')}, re-run loss {d['rerun']['rerun'].get('loss')}")


if __name__ == "__main__":
    main()
