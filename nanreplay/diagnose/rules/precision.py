"""Range and precision, for any op: a low-precision dtype that overflowed, weights that had
already exploded. They claim any op, so they rank below every rule for a specific op; a
low-precision overflow outranks exploded weights (both claim Inf from finite inputs)."""

from __future__ import annotations

import math

import torch

from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site, finite_float
from nanreplay.enums import FixKind


def _low_precision(s: Site) -> bool:
    return s.dtype in ("float16", "bfloat16") or bool(s.subject.autocast)


@rule("fp16_overflow", priority=30)
def _fp16(s: Site) -> Diagnosis | None:
    if not _low_precision(s) or s.event.role != "origin" or s.event.kind != "inf":
        return None
    big = max((st.get("absmax") or 0 for st in s.inputs if isinstance(st.get("absmax"), (int, float))), default=0)
    low = s.dtype if s.dtype in ("float16", "bfloat16") else str((s.subject.autocast or {}).get("dtype", "float16"))
    low = low.removeprefix("torch.")
    lmax = torch.finfo(getattr(torch, low, torch.float16)).max
    auto = s.subject.autocast
    if auto:
        dev = auto.get("device_type", "cuda")
        code = (f"with torch.autocast({dev!r}, dtype=torch.bfloat16):  # instead of {low}\n"
                "    loss = ...\n"
                f"# or keep {low} and scale the loss: scaler = torch.amp.GradScaler({dev!r})")
        variant = {"autocast": {**auto, "dtype": torch.bfloat16}, "label": "under bfloat16 autocast"}
        where_run = f"under torch.autocast({dev!r}, dtype=torch.{low})"
    else:
        code = ("model = model.to(torch.bfloat16)  # same range as float32\n"
                "# or keep float32 weights, run under torch.autocast(..., dtype=torch.float16) and scale the loss "
                "with torch.amp.GradScaler()")
        variant = {"dtype": torch.bfloat16, "label": "in bfloat16"}
        where_run = f"in {low}"
    return Diagnosis("fp16_overflow", f"{low} overflow",
                     f"{s.event.op} produced Inf from finite inputs (|x| up to {big:.4g}) {where_run}, whose largest "
                     f"value is {lmax:.0f} ({s.where}). The same op is finite in a wider dtype. bfloat16 has float32's "
                     "range; in backward, a GradScaler keeps scaled gradients in range and skips the step on overflow.",
                     [Fix(FixKind.BF16_OR_GRAD_SCALER, code, variant=variant,
                          reasoning="bfloat16 trades mantissa bits for float32's exponent range")])


@rule("exploded_weights", priority=20)
def _exploded(s: Site) -> Diagnosis | None:
    """Inf from finite inputs in a full-range dtype, with parameters already huge: an earlier step diverged."""
    if s.event.role != "origin" or s.event.kind != "inf":
        return None
    limit = min(1e5, math.sqrt(s.finfo.max) / 16)
    seen = max((v for v in (finite_float(st.get("absmax")) for st in s.inputs) if v is not None), default=0.0)
    if seen < limit:
        return None  # the overflowing op never saw a huge value: something else is going on
    big = [(n, float(p.detach().abs().max())) for n, p in s.subject.model.named_parameters()
           if p.is_floating_point() and p.numel()]
    huge = [(n, v) for n, v in big if v > limit]
    if not huge:
        return None
    huge.sort(key=lambda nv: -nv[1])
    names = ", ".join(f"{n} (max |w| {v:.3g})" for n, v in huge[:3])
    return Diagnosis("exploded_weights", "weights already exploded",
                     f"{s.event.op} overflowed {s.dtype} (largest value {s.finfo.max:.3g}; its inputs reached "
                     f"{seen:.3g}) at {s.where} because the parameters are already huge: {names}. The step itself is "
                     "not the bug — earlier steps grew the weights. Lower the learning rate, clip gradients, and "
                     "restore the last good checkpoint.",
                     [Fix(FixKind.LOWER_LR_CLIP_GRADS,
                          "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
                          "# and: lower the learning rate; restore the last checkpoint with finite, sane weights",
                          reasoning="the weights themselves are the problem: no change at this op makes them sane "
                                    "again, so there is nothing to verify by replaying this step")])
