"""Replaying `optimizer.step()`: the update an update snapshot recorded, under the same Recorder.

    us = UpdateSubject(...)                      # from a snapshot: formats/native.py's `update_subject`
    upd = run_update(us)                         # instrumented: events in phase "optimizer"
    upd.step.failure                             # the first non-finite parameter after the update

The optimizer is rebuilt from its recorded class *name*, only for torch.optim's own classes
(`REPLAYABLE`), over the weights before the step, with the recorded gradients, hyperparameters,
implementation path (single-tensor, foreach, fused) and state; then its `step()` runs under the
dispatch recorder. Every aten op inside the update is an op record (module "<optimizer>", the
source line inside torch/optim), and every op whose output holds NaN/Inf an event — so the
chain and the culprit mean what they mean for forward and backward. Optimizer state that is
already non-finite is marked, so the first op that reads it in place is not taken for its origin.

`try_update` replays a changed update (another eps, lr, dtype, clipped gradients, reset state)
and says whether it came out finite and plausible.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from nanreplay import stats
from nanreplay.enums import Kind
from nanreplay.errors import ReplayError, first_line
from nanreplay.formats.update_record import REPLAYABLE
from nanreplay.replay.recorder import Recorder, _OpMode, _storage_key
from nanreplay.replay.records import Failure, Step
from nanreplay.replay.run import anomaly_off

OPTIMIZER_MODULE = "<optimizer>"
PLAUSIBLE_UPDATE = 0.5  # an update that moves the weights by more than half their norm is not a sane step
_OPTIM_DIR = os.path.join(os.path.dirname(torch.__file__), "optim") + os.sep
_NOT_HYPER = ("params", "capturable", "differentiable", "foreach", "fused")


@dataclass
class UpdateSubject:
    """One optimizer step, as data: everything `run_update` needs."""

    cls: str
    implementation: str
    groups: list[dict]  # {"params": [names], "hyper": {...}}
    weights: dict[str, torch.Tensor]  # before the step
    grads: dict[str, torch.Tensor]
    state: dict[str, dict]  # before the step; a parameter without an entry had no state
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pre_step: str = "copied"
    lost: dict[str, torch.Tensor] = field(default_factory=dict)
    stand_in: str | None = None
    nonfinite_after: dict[str, dict] = field(default_factory=dict)
    grad_scale: float | None = None
    scheduler: dict | None = None
    history: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [n for g in self.groups for n in g["params"]]

    def group_of(self, name: str) -> dict:
        return next(g["hyper"] for g in self.groups if name in g["params"])

    def dtype_of(self, name: str) -> torch.dtype:
        return self.weights[name].dtype

    def changed(self, *, hyper: dict | None = None, group_hyper: dict[int, dict] | None = None,
                dtype: torch.dtype | None = None, reset: tuple | list = (), clip: float | None = None,
                implementation: str | None = None) -> UpdateSubject:
        """A copy with hyperparameters replaced (`hyper`: in every group; `group_hyper`: per group index),
        weights / gradients / state in `dtype`, the state of the parameters in `reset` dropped (fresh), the
        gradients clipped to total norm `clip`, or another implementation path."""
        group_hyper = group_hyper or {}
        groups = [{"params": list(g["params"]), "hyper": {**g["hyper"], **(hyper or {}), **group_hyper.get(i, {})}}
                  for i, g in enumerate(self.groups)]

        def conv(t):
            return t.to(dtype) if dtype is not None and isinstance(t, torch.Tensor) and t.is_floating_point() else t
        weights = {n: conv(w) for n, w in self.weights.items()}
        grads = {n: conv(g) for n, g in self.grads.items()}
        if clip is not None and grads:
            total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
            if math.isfinite(total) and total > clip:
                grads = {n: (g.double() * (clip / total)).to(g.dtype) for n, g in grads.items()}
        state = {n: {k: (v if k == "step" else conv(v)) for k, v in st.items()}
                 for n, st in self.state.items() if n not in reset}
        return dataclasses.replace(self, groups=groups, weights=weights, grads=grads, state=state,
                                   implementation=implementation or self.implementation)


@dataclass
class UpdateReplay:
    """What one replayed update did."""

    step: Step  # events and op records (phase "optimizer"), failure = the first non-finite parameter
    before: dict[str, torch.Tensor]  # the weights it started from (CPU)
    after: dict[str, torch.Tensor]  # the weights it left (CPU)
    state_after: dict[str, dict[str, torch.Tensor]]
    params_of_ops: list[str | None]  # per op record: the parameter it worked on (single-tensor paths)
    implementation: str  # the path that actually ran
    notes: list[str] = field(default_factory=list)

    @property
    def finite(self) -> bool:
        return self.step.failure is None

    def nonfinite(self, name: str) -> torch.Tensor:
        return ~torch.isfinite(self.after[name])

    def change(self, skip: dict[str, torch.Tensor] | None = None) -> dict:
        """Size of the update: its norm, the weights' norm, their ratio and the largest step (float64, finite
        entries; the weights' norm leaves out entries `skip` marks: stand-ins for weights not recovered)."""
        upd = wn = 0.0
        big = 0.0
        for n, a in self.after.items():
            b = self.before[n].double()
            d = a.double() - b
            ok = torch.isfinite(d)
            upd += float(d[ok].pow(2).sum())
            keep = torch.isfinite(b)
            if skip and n in skip and skip[n].shape == keep.shape:
                keep &= ~skip[n]
            wn += float(b[keep].pow(2).sum())
            if ok.any():
                big = max(big, float(d[ok].abs().max()))
        ratio = math.sqrt(upd) / math.sqrt(wn) if wn > 0 else (0.0 if upd == 0 else math.inf)
        return {"update_norm": math.sqrt(upd), "weight_norm": math.sqrt(wn), "ratio": ratio, "max_abs_update": big}


class UpdateRecorder(Recorder):
    """The Recorder, attributing each op to the optimizer (and, where it can tell, to one parameter)."""

    def __init__(self, leaf_params: dict[int, str]):
        super().__init__({}, site=self._site)
        self.phase = "optimizer"
        self.leaf_params = leaf_params  # id(parameter or its gradient) -> parameter name
        self.params_of_ops: list[str | None] = []
        self._now: str | None = None

    def on_op(self, func, args: tuple, kwargs: dict, out: Any, seq: int) -> None:
        self._now = self._param_of(args)
        super().on_op(func, args, kwargs, out, seq)

    def _param_of(self, args: tuple) -> str | None:
        found = None
        for a in args:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if not isinstance(t, torch.Tensor):
                    continue
                n = self.leaf_params.get(id(t))
                if n is None:
                    i = self.producer.get(t)
                    n = self.params_of_ops[i] if i is not None and i < len(self.params_of_ops) else None
                if n is not None:
                    if found is not None and n != found:
                        return None  # a foreach op over many parameters
                    found = n
        return found

    def _site(self):
        self.params_of_ops.append(self._now)
        return OPTIMIZER_MODULE, _optim_frame(), ()


def _optim_frame():
    """The innermost line of torch/optim running the op (what the update's code says there)."""
    f = sys._getframe(3)
    while f is not None:
        if f.f_code.co_filename.startswith(_OPTIM_DIR):
            return (f.f_code.co_filename, f.f_lineno, f.f_code.co_name, None)
        f = f.f_back
    return None


def optimizer_class(name: str) -> type:
    if name not in REPLAYABLE:
        raise ReplayError(f"cannot replay an update of {name!r}: only torch.optim's own "
                          f"{', '.join(REPLAYABLE)} are rebuilt")
    return getattr(torch.optim, name)


def _hyper(hyper: dict, impl: str) -> dict:
    out = {k: (tuple(v) if isinstance(v, list) else v) for k, v in hyper.items() if k not in _NOT_HYPER}
    out.update(foreach=impl == "foreach", fused=True if impl == "fused" else None, capturable=False,
               differentiable=False)
    return out


def _build(us: UpdateSubject, impl: str):
    cls = optimizer_class(us.cls)
    dev = us.device
    params: dict[str, nn.Parameter] = {}
    for n in us.names:
        p = nn.Parameter(us.weights[n].detach().to(dev, copy=True))
        g = us.grads.get(n)
        if g is not None:
            g = g.to(dev, p.dtype, copy=True)
            p.grad = g / us.grad_scale if us.grad_scale and us.grad_scale != 1.0 else g
        params[n] = p
    groups = [{"params": [params[n] for n in g["params"]], **_hyper(g["hyper"], impl)} for g in us.groups]
    opt = cls(groups)
    for n, st in us.state.items():
        p = params[n]
        opt.state[p] = {k: _state_value(k, v, p, impl) for k, v in st.items()}
    return opt, params


def _state_value(key: str, v: Any, p: torch.Tensor, impl: str) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    if key == "step" and v.dim() == 0:  # torch keeps `step` on the CPU except for fused / capturable
        return v.to(p.device if impl == "fused" else "cpu", torch.float32, copy=True)
    return v.to(p.device, p.dtype if v.is_floating_point() else v.dtype, copy=True)


def run_update(us: UpdateSubject) -> UpdateReplay:
    """Run the recorded update once, instrumented. Raises ReplayError when it cannot run at all."""
    impl = us.implementation
    notes: list[str] = []
    try:
        opt, params = _build(us, impl)
    except ReplayError:
        raise
    except Exception as e:  # noqa: BLE001 - a record torch.optim will not take
        raise ReplayError(f"rebuilding the {us.cls} optimizer raised {type(e).__name__}: {first_line(e)}") from e
    before = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
    leaf = {id(p): n for n, p in params.items()}
    leaf.update({id(p.grad): n for n, p in params.items() if p.grad is not None})
    rec = UpdateRecorder(leaf)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not stats.finite_fast(v):
                rec.bad_leaves[v] = True
    try:
        with anomaly_off(), _OpMode(rec):
            opt.step()
    except Exception as e:  # noqa: BLE001
        if impl == "single_tensor":
            raise ReplayError(f"replaying the {us.cls} update raised {type(e).__name__}: {first_line(e)}") from e
        notes.append(f"the {impl} path could not run here ({type(e).__name__}: {first_line(e, 200)}); "
                     "the single-tensor path was replayed instead")
        out = run_update(dataclasses.replace(us, implementation="single_tensor"))
        out.notes = notes + out.notes
        return out
    failure = _failure(rec, params)
    grads = [stats.grad_stats(n, p) for n, p in params.items()]
    step = Step(loss=None, events=rec.events, ops=rec.ops, op_by_seq=rec.op_by_seq, failure=failure, anomaly=None,
                grads=grads, call_names=[""], internal_errors=rec.internal_errors)
    after = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
    state_after = {n: {k: v.detach().to("cpu", copy=True) for k, v in opt.state[p].items()
                       if isinstance(v, torch.Tensor)} for n, p in params.items() if p in opt.state}
    return UpdateReplay(step, before, after, state_after, rec.params_of_ops, impl, notes)


def _failure(rec: Recorder, params: dict[str, nn.Parameter]) -> Failure | None:
    """The first non-finite parameter after the update: the one whose NaN/Inf the earliest event made."""
    best: Failure | None = None
    for name, p in params.items():
        n, i = stats.kinds(p.detach())
        if not (n or i):
            continue
        hit = rec.nonfinite.get(p)
        ev = hit[0] if hit is not None else rec.by_storage.get(_storage_key(p))
        cand = Failure("parameter", name, Kind.NAN if n else Kind.INF, ev)
        if best is None or (ev is not None and (best.event is None or ev < best.event)):
            best = cand
    return best


@dataclass
class Tried:
    """A changed update, replayed: finite? plausible? and the numbers."""

    ok: bool
    detail: str
    replay: dict
    replayed: UpdateReplay | None = None


def try_update(us: UpdateSubject, label: str, **change: Any) -> Tried:
    """Replay the update with `change` (see UpdateSubject.changed): finite and plausible?"""
    try:
        upd = run_update(us.changed(**change))
    except Exception as e:  # noqa: BLE001 - a change that breaks the optimizer is a failed fix
        return Tried(False, f"replaying the update {label} raised {type(e).__name__}: {first_line(e)}",
                     {"plausible": False, "why": "the replay raised"})
    size = upd.change(us.lost)
    if not upd.finite:
        f = upd.step.failure
        bad = sum(int(upd.nonfinite(n).sum()) for n in upd.after)
        return Tried(False, f"replayed the update {label}: {bad} weight entries are still NaN/Inf (first: {f.name})",
                     {**size, "plausible": False, "why": "non-finite weights"}, upd)
    plausible = size["ratio"] <= PLAUSIBLE_UPDATE
    why = (f"the update moves the weights by {100 * size['ratio']:.3g}% of their norm "
           f"({'within' if plausible else 'more than'} the {100 * PLAUSIBLE_UPDATE:.0f}% a sane step stays within)")
    bound = step_bound(us)
    if plausible and bound is not None:
        plausible = size["max_abs_update"] <= bound[0]
        why += (f"; its largest step is {size['max_abs_update']:.3g}, {'within' if plausible else 'beyond'} "
                f"{bound[1]}")
    detail = f"replayed the update {label}: every weight finite; {why}"
    return Tried(plausible, detail, {**size, "plausible": plausible, "why": why}, upd)


ADAM_FAMILY = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam")


def step_bound(us: UpdateSubject) -> tuple[float, str] | None:
    """The largest per-entry step an optimizer takes by design, where it has one: Adam-family steps stay near
    lr per entry (at most lr·(1-β1)/√(1-β2), about 3.2·lr with default betas); 10·lr is beyond any of them."""
    if us.cls not in ADAM_FAMILY:
        return None
    lrs = [float(g["hyper"].get("lr")) for g in us.groups if isinstance(g["hyper"].get("lr"), (int, float))]
    lr = max(lrs, default=math.nan)
    if not math.isfinite(lr) or lr <= 0:
        return None
    return 10 * lr, f"the 10·lr = {10 * lr:.3g} that bounds an {us.cls} step by design"


def summary(t: torch.Tensor) -> dict:
    """Statistics of a tensor's entries (those selected by the caller), for sentences and JSON."""
    return stats.tensor_stats(t.detach().reshape(-1))
