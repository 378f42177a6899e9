"""Is a finite replay also a *plausible* one? A fix is verified only when it is.

A fix that makes the step finite can still wreck it: a clamp that turns an outlier into a loss
of 277 where training sat at 0.8–1.5 is not a fix. So the replay's loss and gradient norm are
compared with a reference:

* the snapshot's recent history (`snapshot_info.history`: {step, loss, grad_norm} of the steps
  before this one) — the largest |loss| and gradient norm seen there;
* without history, this step's finite parts: its own loss when that was finite (a gradient
  failure) or the loss of its finite elements (see `_FiniteParts`; not where most of some op's
  input broke), and the gradient norm of the parameters whose gradients were finite;
* without either, the same step in float64 where that is finite (a range problem: a float16 overflow).

Plausible means an |loss| within `LOSS_FACTOR` (10×) and a gradient norm within `GRAD_FACTOR` (100×)
of the reference's largest: one step's gradient norm varies more than its loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanreplay import replay, stats
from nanreplay import torch_internals as ti
from nanreplay.diagnose.site import finite_float

LOSS_FACTOR = 10.0  # a replay is plausible when its |loss| is at most this many times the reference's ...
GRAD_FACTOR = 100.0  # ... and its gradient norm at most this many times (one step's norm varies more)
aten = torch.ops.aten


@dataclass
class Reference:
    source: str  # in words: "the recent history (steps 0–4)", "this step's finite parts"
    loss: float | None  # the largest |loss| to compare with
    grad_norm: float | None  # the largest gradient norm to compare with
    params: frozenset[str] | None = None  # this step's finite parts: the gradient norm over these parameters only


class Lazy:
    """A value computed the first time it is asked for (a reference costs a forward pass when there is no history:
    only worth it once some fix has replayed finite)."""

    def __init__(self, make):
        self._make, self._done, self._value = make, False, None

    def get(self):
        if not self._done:
            self._value, self._done = self._make(), True
        return self._value


def history_rows(info: dict) -> list[dict]:
    """The history rows of the steps before the snapshot's own step."""
    rows = [r for r in info.get("history") or [] if isinstance(r, dict)]
    step = info.get("step")
    if step is not None:
        return [r for r in rows if r.get("step") != step]
    return rows[:-1]


BROKEN_SHARE = 0.9  # where an op had to drop more of its input than this, the finite parts tell nothing


def reference(info: dict, step: replay.Step, subject) -> Reference | None:
    """What a fixed step is compared with: the recent history, else this step's finite parts, else the
    same step in float64 where that is finite (a range problem: the wider dtype computes what was meant)."""
    rows = history_rows(info)
    losses = [abs(v) for r in rows if (v := finite_float(r.get("loss"))) is not None]
    norms = [v for r in rows if (v := finite_float(r.get("grad_norm"))) is not None]
    if losses or norms:
        steps = [r.get("step") for r in rows if isinstance(r.get("step"), int)]
        span = f"steps {min(steps)}–{max(steps)}" if steps else f"{len(rows)} steps"
        return Reference(f"the recent history ({span})", max(losses) if losses else None,
                         max(norms) if norms else None)
    scale = subject.loss_scale or 1.0
    loss = finite_float(step.loss)
    if loss is not None:
        loss = abs(loss) / scale
    else:
        loss = finite_part_loss(subject)
    grad, params = None, None
    if step.failure is not None and step.failure.what == "gradient":
        rows = [g for g in step.grads if g.get("has_grad") and not g["nan"] and not g["inf"]]
        sq = [n for g in rows if (n := norm_squared(g)) is not None]
        if sq:
            grad, params = math.sqrt(sum(sq)) / scale, frozenset(g["name"] for g in rows)
    if loss is None and grad is None:
        f64 = float64_loss(subject)
        return Reference("the same step in float64", f64, None) if f64 is not None else None
    return Reference("this step's finite parts", loss, grad, params)


def norm_squared(g: dict) -> float | None:
    """‖g‖² from the per-parameter walk's mean and (unbiased) std: (n - 1) std² + n mean²."""
    n = math.prod(g.get("shape") or [1])
    mean, std = finite_float(g.get("mean")), finite_float(g.get("std"))
    if mean is None or std is None:
        return None
    return (n - 1) * std * std + n * mean * mean


def judge(loss: float | None, grad_norm: float | None, grad_norms: dict[str, float] | None,
          ref: Reference | None) -> tuple[bool | None, str]:
    """(plausible, why) for a finite replay; None when there is nothing to compare with."""
    if ref is None:
        return None, "no recent history and no finite part of this step to compare with: plausibility not judged"
    parts, bad = [], []
    if ref.loss is not None and loss is not None:
        limit = LOSS_FACTOR * max(ref.loss, 1e-12)
        (parts if abs(loss) <= limit else bad).append(
            f"|loss| {abs(loss):.4g} {'≤' if abs(loss) <= limit else '>'} {LOSS_FACTOR:g} × {ref.loss:.4g}")
    g = grad_norm
    if ref.params is not None and grad_norms is not None:
        g = math.sqrt(sum(v * v for n, v in grad_norms.items() if n in ref.params))
    if ref.grad_norm is not None and g is not None:
        limit = GRAD_FACTOR * max(ref.grad_norm, 1e-12)
        what = "gradient norm" if ref.params is None else "gradient norm of the parameters whose gradients were finite"
        (parts if g <= limit else bad).append(f"{what} {g:.4g} {'≤' if g <= limit else '>'} {GRAD_FACTOR:g} × "
                                              f"{ref.grad_norm:.4g}")
    if not parts and not bad:
        return None, f"nothing in {ref.source} to compare this replay with: plausibility not judged"
    if bad:
        return False, f"finite but implausible against {ref.source}: {'; '.join(bad)}"
    return True, f"plausible against {ref.source}: {'; '.join(parts)}"


# ------------------------------------------------------------------ this step's finite parts


def _broken(t: torch.Tensor) -> float:
    """The share of `t`'s elements that are NaN or Inf."""
    return float((~torch.isfinite(t)).sum()) / max(t.numel(), 1)


def _zeroed(a):
    return torch.nan_to_num(a, 0.0, 0.0, 0.0) if isinstance(a, torch.Tensor) and a.is_floating_point() else a


class _FiniteParts(ti.TorchDispatchMode):
    """The step without the elements that broke: a sum or mean over non-finite values (and a loss op's
    `reduction`) is taken over the finite ones, a sum of scalar terms drops the broken terms, an op that
    mixes elements (a matmul, a normalisation) sees its non-finite inputs as 0; elementwise ops let
    NaN/Inf through, to be dropped where they are reduced. `dropped` is the largest share of an op's
    input that had to go: where most of it broke, what is left says nothing about the step."""

    _REDUCE = {aten.sum, aten.mean, aten.nansum, aten.nanmean}

    def __init__(self):
        super().__init__()
        self.dropped = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        floats = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        bad = [a for a in floats if not stats.finite_fast(a)]
        if not bad:
            return func(*args, **kwargs)
        pk, x = func.overloadpacket, args[0] if args else None
        names = [a.name for a in func._schema.arguments]
        if pk in self._REDUCE and isinstance(x, torch.Tensor) and x.is_floating_point():
            self.dropped = max(self.dropped, _broken(x))
            return _finite_reduction(pk, x, args, kwargs)
        if pk in (aten.add, aten.sub) and all(a.numel() == 1 for a in floats):  # a loss made of terms
            if len(bad) < len(floats):
                self.dropped = max(self.dropped, len(bad) / len(floats))
                return func(*[_zeroed(a) for a in args], **kwargs)
            return func(*args, **kwargs)
        if "reduction" in names and isinstance(x, torch.Tensor):
            return self._loss_op(func, names.index("reduction"), args, kwargs)
        if torch.Tag.pointwise not in func.tags and not ti.op_is_view(func):
            self.dropped = max(self.dropped, *(_broken(a) for a in bad))
            return func(*[_zeroed(a) for a in args], **{k: _zeroed(v) for k, v in kwargs.items()})
        return func(*args, **kwargs)

    def _loss_op(self, func, i: int, args: tuple, kwargs: dict):
        """A loss op (mse_loss, nll_loss, ...) over non-finite values: per element, then over the finite ones."""
        red = kwargs.get("reduction", args[i] if i < len(args) else 1)
        if red not in (1, 2):
            return func(*args, **kwargs)
        args2 = list(args) + [None] * (i + 1 - len(args))
        args2[i] = 0
        out = func(*args2[:max(len(args), i + 1)], **{k: v for k, v in kwargs.items() if k != "reduction"})
        first = out[0] if isinstance(out, tuple) else out
        self.dropped = max(self.dropped, _broken(first))
        ok = torch.isfinite(first)
        agg = torch.where(ok, first, 0).sum()
        agg = agg / ok.sum() if red == 1 else torch.where(ok.any(), agg, math.nan)
        return (agg.to(first.dtype), *out[1:]) if isinstance(out, tuple) else agg.to(first.dtype)


def _finite_reduction(pk, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keep = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    ok = torch.isfinite(x)
    z = torch.where(ok, x, 0)
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        s, n = z.sum(), ok.sum()
    else:
        s, n = z.sum(dims, keepdim=keep), ok.sum(dims, keepdim=keep)
    out = torch.where(n > 0, s, math.nan) if pk in (aten.sum, aten.nansum) else s / n  # nothing finite: no part
    return out.to(kwargs.get("dtype") or x.dtype)


def finite_part_loss(subject) -> float | None:
    """The step's loss over its finite elements only (forward on an independent copy, no gradients)."""
    try:
        copy = subject.converted()
        if copy.prepare is not None:
            copy.prepare()
        mode = _FiniteParts()
        with torch.no_grad(), replay.anomaly_off(), replay.autocast_from(copy.autocast), mode:
            loss = copy.loss(copy.forward())
        v = float(loss.detach().double())
    except Exception:  # noqa: BLE001 - an estimate, never a reason to fail the analysis
        return None
    if not math.isfinite(v) or mode.dropped > BROKEN_SHARE:
        return None
    return abs(v) / (subject.loss_scale or 1.0)


def float64_loss(subject) -> float | None:
    """The step's loss in float64 (an independent copy, forward only): the reference for a range problem."""
    try:
        copy = subject.converted(torch.float64, None if subject.autocast else "same")
        if copy.prepare is not None:
            copy.prepare()
        with torch.no_grad(), replay.anomaly_off():
            v = float(copy.loss(copy.forward()).detach())
    except Exception:  # noqa: BLE001
        return None
    return abs(v) / (subject.loss_scale or 1.0) if math.isfinite(v) else None


# ------------------------------------------------------------------ a reference of the same step

SAME_RTOL = 1e-2  # a fixed step agrees with a reference of the same step when its loss is within 1 % of it
SAME_ATOL = 1e-6  # ... or within this much (a loss whose terms cancel to ~0 is all rounding)


@dataclass
class SameStep:
    """What a fixed replay of *this* step is compared with, before any history: the loss of an exact
    reformulation that verified (xlogy, log_softmax, ...), the step's own loss where it was finite (a gradient
    failure), and the same fix with ε two decades larger (the loss must not depend on an arbitrary ε)."""
    exact: tuple[str, float] | None = None  # (what, loss) of a verified exact reformulation of this step
    own: float | None = None  # the step's own finite loss (unscaled)


def agree(a: float, b: float) -> bool:
    return abs(a - b) <= SAME_RTOL * max(abs(a), abs(b)) + SAME_ATOL


def judge_same_step(loss: float | None, same: SameStep, probe_loss: float | None, eps: float | None
                    ) -> tuple[bool | None, str]:
    """(plausible, why) against references of the same step; (None, "") when there is none to compare with.
    Every reference there is must agree."""
    if loss is None:
        return None, ""
    parts, bad = [], []
    for what, ref in ([same.exact] if same.exact else []) + ([("the step's own finite loss", same.own)]
                                                             if same.own is not None else []):
        (parts if agree(loss, ref) else bad).append(f"loss {stats.num(loss)} {'≈' if agree(loss, ref) else '≠'} "
                                                     f"{stats.num(ref)}, {what}")
    if probe_loss is not None and eps is not None:
        e2 = eps * 100
        (parts if agree(loss, probe_loss) else bad).append(
            f"the loss {'does not move' if agree(loss, probe_loss) else 'moves'} when ε changes by two decades "
            f"({stats.num(loss)} at ε = {eps:.0e}, {stats.num(probe_loss)} at ε = {e2:.0e})")
    if bad:
        return False, f"finite but implausible against the same step: {'; '.join(bad)}"
    if parts:
        return True, f"plausible against the same step: {'; '.join(parts)}"
    return None, ""


UNUSUAL = "this batch is unusual"


def unusual_batch(loss: float | None, ref: Reference | None) -> str:
    """A note, never a verdict: the batch itself is far from the recent history (its scale, not the fix)."""
    if loss is None or ref is None or ref.loss is None or not ref.source.startswith("the recent history"):
        return ""
    if abs(loss) <= LOSS_FACTOR * max(ref.loss, 1e-12):
        return ""
    return (f"; {UNUSUAL}: its fixed loss {abs(loss):.4g} is {abs(loss) / max(ref.loss, 1e-12):.3g}× "
            f"the largest in {ref.source} ({ref.loss:.4g}) — the batch's scale, not the fix")
