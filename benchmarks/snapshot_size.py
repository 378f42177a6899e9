"""Snapshot size vs the data a snapshot must hold: weights + optimizer state + batch, each saved once.

    python benchmarks/snapshot_size.py

The reference transformer (4 layers, d=384, seq 256, batch 16) with Adam state, trained one step,
then a NaN step captured by NanGuard. The baseline is one `torch.save` of exactly
{state_dict, optimizer.state_dict(), batch}; the ratio is snapshot / baseline (target <= 1.15).
It also prints how long recording the step program took and how big the program is.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import transformer as T  # noqa: E402
from nanreplay import NanGuard  # noqa: E402

TARGET = 1.15


def main() -> None:
    torch.manual_seed(0)
    model = T.build_nan()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    idx, tgt = T.batch()
    with tempfile.TemporaryDirectory() as tmp:
        guard = NanGuard(model, opt, loss_fn=T.loss_fn, folder=tmp)
        # one healthy-looking optimizer step first, so Adam has its state (the NaN layer is the same)
        opt.zero_grad()
        T.loss_fn(model(idx), tgt).backward()
        for p in model.parameters():
            p.grad = torch.nan_to_num(p.grad)
        opt.step()
        guard.begin(idx, tgt, step=1)
        loss = T.loss_fn(model(idx), tgt)
        t0 = time.perf_counter()
        assert not guard.loss_ok(loss), "the reference step did not go non-finite"
        write_s = time.perf_counter() - t0
        snap = Path(guard.last_snapshot)
        size = snap.stat().st_size
        d = torch.load(snap, weights_only=True)
    buf = io.BytesIO()
    torch.save({"state": model.state_dict(), "optimizer": opt.state_dict(), "batch": (idx, tgt)}, buf)
    base = buf.tell()
    prog = d["step_program"] or ""
    consts = sum(t.numel() * t.element_size() for t in (d.get("constants") or {}).values())
    nodes = len(json.loads(prog)["nodes"]) if prog else 0
    ratio = size / base
    print(f"snapshot {size / 1e6:.2f} MB vs weights+optimizer+batch saved once {base / 1e6:.2f} MB: "
          f"{ratio:.3f}x (target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'})")
    print(f"  step program: {nodes} ops, {len(prog) / 1e3:.0f} kB of JSON; constants {consts / 1e6:.2f} MB")
    print(f"  guard: snapshot written in {write_s:.2f} s (recording the step took {d['record_seconds']} s)")


if __name__ == "__main__":
    main()
