"""What the per-op argument checks (formats/opchecks.py) cost: the reference transformer's step program,
replayed forward+backward with the checks and without them, in paired rounds (median ratio and spread),
and its dry run likewise.

    python benchmarks/validation_overhead.py [--rounds 7] [--batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformer  # noqa: E402

from nanreplay.capture.program import record_step  # noqa: E402
from nanreplay.formats import dryrun, opchecks  # noqa: E402
from nanreplay.formats.program import decode, to_json  # noqa: E402
from nanreplay.formats.stepmodel import StepModule  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = transformer.build()
    x, y = transformer.batch(args.batch)
    rec = record_step(lambda: model(x), lambda out: transformer.loss_fn(out, y), model=model,
                      batch={"inputs": x, "target": y})
    program = decode(to_json(rec.program))
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    module = StepModule(program, {k: v.detach() for k, v in state.items()}, [n for n, _ in model.named_parameters()],
                        {}, rec.constants)
    leaf_meta = {lf.ref: (lf.shape, getattr(torch, lf.dtype)) for lf in program.leaves}
    real_check = opchecks.check

    def step() -> float:
        t0 = time.perf_counter()
        module(x, y).backward()
        module.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def dry() -> float:
        t0 = time.perf_counter()
        dryrun.dry_run(program, leaf_meta)
        return time.perf_counter() - t0

    spent = [0.0]

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_check(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
    opchecks.check = timed
    total = step()
    opchecks.check = real_check
    print(f"the checks themselves: {spent[0] * 1e3:.2f} ms of a {total * 1e3:.0f} ms forward+backward "
          f"({spent[0] / total:.2%})")
    for label, fn in (("replay forward+backward", step), ("dry run", dry)):
        fn()  # warm up
        ratios, on_t, off_t = [], [], []
        for _ in range(args.rounds):
            opchecks.check = real_check
            on = fn()
            opchecks.check = lambda *a, **k: None
            off = fn()
            opchecks.check = real_check
            ratios.append(on / off)
            on_t.append(on)
            off_t.append(off)
        print(f"{label}: {len(program.nodes)} nodes, with checks {statistics.median(on_t) * 1e3:.1f} ms, without "
              f"{statistics.median(off_t) * 1e3:.1f} ms, ratio {statistics.median(ratios):.3f} "
              f"(spread {min(ratios):.3f}-{max(ratios):.3f}, {args.rounds} paired rounds)")


if __name__ == "__main__":
    main()
