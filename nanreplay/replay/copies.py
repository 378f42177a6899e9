"""Ops whose every output element is one of their inputs' elements (or a finite constant): no scan needed.

The replay proves each op output finite with one `sum` (recorder.Recorder.on_op). An op that only moves,
selects, pads or widens values cannot make a non-finite value out of finite ones: when every floating input is
one the replay itself proved finite, and has not been written since (its version counter, which views share with
their base, is the one it had then), the output is finite, and the sum would say so. Skipping that sum changes
no record: a finite output of an op records nothing. A third of a transformer step's scanned elements are such
copies (`_unsafe_view`, `clone`, `masked_fill` with the causal mask's finite fill, `cat`).

Excluded on purpose: anything that computes (dropout's scale, sums, `index_put` with accumulate, `embedding_
dense_backward`), in-place and `out=` ops (the recorder's mutation path), uninitialised outputs (`empty_like`),
narrowing casts (float32 -> float16 overflows: a real culprit), and a fill/pad/clamp value that is not finite.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    out = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:  # (an op this torch does not have is simply never skipped)
            out.add(op)
    return frozenset(out)


COPIES = _ops(
    "clone", "_unsafe_view", "cat", "stack", "index_select", "gather", "index.Tensor", "take_along_dim",
    "repeat", "expand_copy", "permute_copy", "transpose_copy.int", "t_copy", "view_copy", "flip", "roll",
    "slice_backward", "select_backward", "constant_pad_nd", "masked_fill.Scalar", "masked_fill.Tensor",
    "where.self", "relu", "threshold_backward", "abs", "neg", "maximum", "minimum", "amax", "amin",
    "max.dim", "min.dim", "zeros_like", "ones_like", "new_zeros", "new_ones", "_to_copy",
)


def inputs_proved_finite(args, kwargs, proved, bad_storage: dict, storage_key) -> list | None:
    """The floating inputs of a copy op when every one is in `proved` (tensor -> version when proved finite) at
    that version, none shares memory a NaN/Inf was written to (`bad_storage`: through `.data`, whose writes bump
    another version counter), and no scalar argument is NaN/Inf; else None."""
    floats = []
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, float) and not math.isfinite(t):  # a fill, pad or clamp value
                return None
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                if t.is_complex() or proved.get(t) != version(t):  # (complex: |z| can overflow)
                    return None
                if bad_storage and bad_storage.get(storage_key(t)) is not None:
                    return None
                floats.append(t)
    return floats


def version(t: torch.Tensor) -> int | None:
    """`t`'s version counter (shared by a view and its base; every in-place write bumps it); None where it has
    none (an inference-mode tensor): never proved."""
    try:
        return t._version
    except RuntimeError:
        return None


def prove(proved, outs) -> None:
    for t in outs:
        if t.is_floating_point():
            v = version(t)
            if v is not None:
                proved[t] = v


def widens(outs: list, floats: list) -> bool:
    """No floating output narrower than a floating input (a cast to a smaller range can overflow)."""
    if not floats:
        return True
    least = min(torch.finfo(t.dtype).max for t in floats)
    return all(not t.is_floating_point() or torch.finfo(t.dtype).max >= least for t in outs)
