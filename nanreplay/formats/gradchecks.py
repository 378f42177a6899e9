"""Argument checks for the derivative kernels and solver helpers that trust their companions' shapes.

(The derivative kernels that `create_graph=True` runs as forward ops, issue 38, are checked in
formats/derivchecks.py.) The kernels below are ones whose public forms
check (`layer_norm`, `log_softmax`, `cholesky_solve` compare the shapes they are given), but which a step program
can call directly; their meta kernels compute the output's shape from one argument without looking at the others,
so the dry run passed what the kernel then trusted (crafted files, round 4, docs/trust.md):

* `native_layer_norm_backward` reads one `mean` and one `rstd` per normalised row of the input, and one
  incoming gradient per input element, without comparing their sizes: 1-element statistics for 8 rows
  read the heap into `grad_weight` (the values of a freed buffer came back in the result);
* `_log_softmax_backward_data` walks `output` as far as `grad_output` reaches: a 1-row output for an 8-row
  gradient reads past it (`_softmax_backward_data` compares them itself);
* `_cholesky_solve_helper` (what `cholesky_solve` calls after broadcasting) solves one system per batch
  of `self` with the matrix of the same batch of `A`, trusting both to have one batch shape and `A` to be
  square with as many rows as `self`: 64 matrices for one right-hand side corrupted the heap (glibc abort).

`formats/opchecks.py` adds these to its table: they run where it runs (the dry run and every replay). Each gets
the call's arguments by name (`call["input"]`) and returns why the call is refused, or None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _shape(t) -> tuple[int, ...] | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _layer_norm_backward(call: Any) -> str | None:
    x, g, norm = _shape(call["input"]), _shape(call["grad_out"]), call["normalized_shape"]
    if x is None:
        return None
    if not isinstance(norm, list) or not norm or len(norm) > len(x) or tuple(norm) != x[len(x) - len(norm):]:
        return f"normalized_shape {norm} is not the trailing dimensions of the input {list(x)}"
    if g is not None and g != x:
        return f"grad_out is {list(g)}, not the input's shape {list(x)}"
    rows = 1
    for n in x[:len(x) - len(norm)]:
        rows *= n
    for name in ("mean", "rstd"):
        t = call[name]
        if isinstance(t, torch.Tensor) and t.numel() != rows:
            return f"{name} holds {t.numel()} values, not one per normalised row of the input ({rows})"
    for name in ("weight", "bias"):
        s = _shape(call[name])
        if s is not None and s != tuple(norm):
            return f"{name} is {list(s)}, not normalized_shape {norm}"
    return None


def _softmax_backward(call: Any) -> str | None:
    g, out = _shape(call["grad_output"]), _shape(call["output"])
    if g is not None and out is not None and g != out:
        return f"grad_output is {list(g)} but output is {list(out)}: the kernel reads one per the other"
    return None


def _cholesky_solve_helper(call: Any) -> str | None:
    b, a = _shape(call["self"]), _shape(call["A"])
    if b is None or a is None:
        return None
    if len(b) < 2 or len(a) < 2 or a[-1] != a[-2] or a[-1] != b[-2]:
        return f"A {list(a)} is not a batch of square matrices with as many rows as self {list(b)}"
    if a[:-2] != b[:-2]:
        return f"A's batch {list(a[:-2])} is not self's {list(b[:-2])} (the kernel does not broadcast)"
    return None


# op packet -> its check (registered in opchecks' RULES)
GRAD_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "native_layer_norm_backward": _layer_norm_backward,
    "_log_softmax_backward_data": _softmax_backward,
    "_softmax_backward_data": _softmax_backward,
    "_cholesky_solve_helper": _cholesky_solve_helper,
}
