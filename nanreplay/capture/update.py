"""The update check: NanGuard's look at the weights right after `optimizer.step()`.

`UpdateWatch` puts two hooks on the optimizer:

* a step pre-hook that costs a loop over the parameter groups: it notes a non-finite learning
  rate (a scheduler bug) and then — or on every step with `keep_pre_step=True` — copies the
  weights and the optimizer state before the update, so that the snapshot holds them exactly;
* a step post-hook: one fused reduction over the weights (`torch._foreach_norm`, one kernel on
  CUDA, one host sync). A finite sum of norms proves every weight finite; only when it is not
  does an exact per-tensor check run (a float32 norm of huge, finite weights can overflow).

When the weights turn non-finite, `update_record()` builds what a replay of the update needs:
the gradients (which `step()` does not change), the optimizer's class name, hyperparameters,
implementation path and state, and the weights before the step — copied, or recovered from
the post-step state where the update is invertible (`capture/invert.py`), or, for optimizers
it cannot invert, the weights after the step (then the analysis cannot replay the update and
says so). The hooks hold the guard weakly and are removed by `close()` or when the guard is
garbage-collected.

This module imports only torch.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from nanreplay import torch_internals as ti
from nanreplay.capture import invert, owned, plain


def implementation(optimizer: torch.optim.Optimizer) -> str:
    """The kernel path the optimizer takes: 'fused', 'foreach' or 'single_tensor' (torch's own default rule)."""
    groups = optimizer.param_groups
    if any(g.get("fused") for g in groups):
        return "fused"
    if any(g.get("foreach") for g in groups):
        return "foreach"
    if any(g.get("foreach") is False or g.get("differentiable") for g in groups):
        return "single_tensor"
    params = [p for g in groups for p in g["params"]]
    return "foreach" if ti.default_foreach(params) else "single_tensor"


def by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The floating (or complex), non-empty tensors, one list per device (a fused kernel runs on one device)."""
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            out.setdefault(t.device, []).append(t)
    return list(out.values())


@torch.no_grad()
def all_finite(groups: list[list[torch.Tensor]]) -> bool:
    """Every entry finite: one fused norm per device and one host sync; an exact check only on a miss (a float32
    norm of huge, finite weights can overflow)."""
    for ts in groups:
        if not math.isfinite(float(torch.stack(ti.foreach_norm(ts)).sum())):
            return all(bool(torch.isfinite(t).all()) for t in ts)
    return True


def _plain(v: Any) -> Any:
    """A hyperparameter as plain data (tensors of one element become numbers, numpy scalars Python numbers,
    tuples lists); None: not storable."""
    if isinstance(v, torch.Tensor):
        return float(v.detach().cpu().reshape(())) if v.numel() == 1 else None
    try:
        v = plain.data(v, unknown=plain.refuse)
    except plain.NotData:
        return None
    if isinstance(v, torch.Tensor):  # a numpy array
        return float(v.reshape(())) if v.numel() == 1 else None
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list) and len(v) <= 16:
        items = [_plain(x) for x in v]
        return items if all(x is not None or y is None for x, y in zip(items, v, strict=True)) else None
    return None


def hyperparameters(group: dict) -> dict:
    return {k: pv for k, v in group.items() if k != "params" and isinstance(k, str)
            for pv in (_plain(v),) if pv is not None or v is None}


def _state_copy(state: dict) -> dict:
    """A parameter's optimizer state: its tensors (CPU copies) and numbers (plain Python ones)."""
    out = {}
    for k, v in state.items():
        if not isinstance(k, str):
            continue
        v = plain.data(v, unknown=lambda x: None)
        if isinstance(v, (torch.Tensor, int, float)):
            out[k] = v
    return out


class PreStep:
    """Exact copies of the weights and the optimizer state taken just before a step (device buffers, reused)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, str], torch.Tensor] = {}
        self.weights: dict[int, torch.Tensor] = {}  # id(param) -> copy
        self.state: dict[int, dict] = {}  # id(param) -> {key: copy}
        self.taken = False

    @torch.no_grad()
    def take(self, optimizer: torch.optim.Optimizer) -> None:
        src, dst = [], []
        weights: dict[int, torch.Tensor] = {}
        state: dict[int, dict] = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                weights[id(p)] = self._buf((id(p), ""), p, src, dst)
                st = optimizer.state.get(p)
                if st:
                    state[id(p)] = {k: (self._buf((id(p), k), v, src, dst) if isinstance(v, torch.Tensor) else v)
                                    for k, v in st.items()}
        if dst:
            ti.foreach_copy(dst, src)
        self.weights, self.state, self.taken = weights, state, True

    def _buf(self, key: tuple[int, str], t: torch.Tensor, src: list, dst: list) -> torch.Tensor:
        b = self._bufs.get(key)
        if b is None or b.shape != t.shape or b.dtype != t.dtype or b.device != t.device:
            b = self._bufs[key] = torch.empty_like(t, memory_format=torch.preserve_format)
        src.append(t.detach())
        dst.append(b)
        return b

    def forget(self) -> None:
        self.taken = False


def unwrap_optimizer(opt: Any) -> torch.optim.Optimizer | None:
    """The torch.optim optimizer inside a framework's wrapper (accelerate's `.optimizer`, Lightning's `._optimizer`)."""
    for _ in range(5):
        # accelerate's AcceleratedOptimizer subclasses torch.optim.Optimizer without running its __init__ (no
        # hooks of its own): look inside any wrapper first, and take an optimizer only when nothing is inside
        inner = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
        if inner is None or inner is opt:
            return opt if isinstance(opt, torch.optim.Optimizer) else None
        opt = inner
    return opt if isinstance(opt, torch.optim.Optimizer) else None


class UpdateWatch:
    """The optimizer hooks of one guard. `on_failure(optimizer, step_kwargs)` runs when weights turn non-finite."""

    def __init__(self, owner: Any, optimizer: torch.optim.Optimizer, on_failure: Callable, on_healthy: Callable,
                 keep_pre_step: bool = False):
        self.keep_pre_step = keep_pre_step
        self.pre = PreStep()
        self.lr_bad = False
        self._key: tuple = ()
        self._groups: list[list[torch.Tensor]] = []
        self._owner = weakref.ref(owner)
        self._on_failure, self._on_healthy = on_failure, on_healthy  # unbound functions taking (owner, ...)
        self.handles = [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]
        self._finalizer = weakref.finalize(owner, _remove, list(self.handles))

    def close(self) -> None:
        self._finalizer()

    def _before(self, optimizer, args, kwargs) -> None:
        owner = self._owner()
        if owner is None:
            return
        try:
            self.lr_bad = any(isinstance(g.get("lr"), float) and not math.isfinite(g["lr"])
                              for g in optimizer.param_groups)
            if self.keep_pre_step or self.lr_bad:
                self.pre.take(optimizer)
            else:
                self.pre.forget()
        except Exception:  # noqa: BLE001 - an observer must never break the training step
            self.pre.forget()

    def _after(self, optimizer, args, kwargs) -> None:
        owner = self._owner()
        if owner is None:
            return
        try:
            finite = all_finite(self._params(optimizer))
        except Exception:  # noqa: BLE001 - an observer must never break the training step
            return
        if finite:
            self._on_healthy(owner, optimizer)
        else:
            self._on_failure(owner, optimizer, kwargs)

    def _params(self, optimizer) -> list[list[torch.Tensor]]:
        """The parameters by device, cached while the optimizer's parameter lists stay the same."""
        key = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        if key != self._key:
            self._key = key
            self._groups = by_device([p for g in optimizer.param_groups for p in g["params"]])
        return self._groups


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()


# ------------------------------------------------------------------ the record an update snapshot holds


def _counts(t: torch.Tensor) -> dict:
    n = t.numel()
    t = ti.real_values(t.detach())  # (a complex weight: its real and imaginary parts)
    return {"numel": n, "nan": int(torch.isnan(t).sum()), "posinf": int(torch.isposinf(t).sum()),
            "neginf": int(torch.isneginf(t).sum())}


def scheduler_record(scheduler: Any) -> dict | None:
    if scheduler is None:
        return None
    out: dict[str, Any] = {"class": type(scheduler).__name__}
    with contextlib.suppress(Exception):
        out["last_lr"] = [float(x) for x in scheduler.get_last_lr()]
    for k in ("last_epoch",):
        v = getattr(scheduler, k, None)
        if isinstance(v, int) and not isinstance(v, bool):
            out[k] = v
    base = getattr(scheduler, "base_lrs", None)
    if isinstance(base, (list, tuple)):
        with contextlib.suppress(TypeError, ValueError):
            out["base_lrs"] = [float(x) for x in base]
    return out


def update_record(optimizer: torch.optim.Optimizer, model: nn.Module, pre: PreStep | None, *,
                  scheduler: Any = None, step_kwargs: dict | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the snapshot's `update` field, the weights before the step by parameter name, on the CPU)."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    cls = type(optimizer).__name__
    impl = implementation(optimizer)
    groups, state, grads, weights, lost, after, extra = [], {}, {}, {}, {}, {}, {}
    notes: list[str] = []
    exact = pre is not None and pre.taken
    invertible = cls in invert.INVERTIBLE and type(optimizer).__module__.startswith("torch.optim")
    how = "copied" if exact else "reconstructed" if invertible else "post_step"
    pairs = []
    for gi, g in enumerate(optimizer.param_groups):
        gnames = [names.get(id(p), f"<optimizer group {gi} param {pi}>") for pi, p in enumerate(g["params"])]
        pairs += [(gi, n, p) for n, p in zip(gnames, g["params"], strict=True)]
        groups.append({"params": gnames, "hyper": hyperparameters(g)})
    for gi, name, p in pairs:
        p_new = p.detach().to("cpu", copy=True)
        after[name] = _counts(p_new)
        if p.grad is not None and not p.grad.is_sparse:
            grads[name] = p.grad.detach().to("cpu", copy=True)
        post_state = _state_copy(optimizer.state.get(p) or {})
        w, st = p_new, post_state or None
        if how == "copied":
            w = pre.weights[id(p)].to("cpu", copy=True)
            st = _state_copy(pre.state[id(p)]) if id(p) in pre.state else None
        elif how == "reconstructed":
            rec = invert.recover(cls, optimizer.param_groups[gi], p_new, grads.get(name), post_state)
            if rec is None:
                notes.append(f"{name}: its value before the step cannot be recovered from {cls}'s state "
                             "(capture with keep_pre_step=True for an exact copy)")
                how = "post_step"
            else:
                w, st = rec.weight, rec.state
                if bool(rec.lost.any()):
                    lost[name] = rec.lost
        if st:
            state[name] = st
        if id(p) not in names:
            extra[name] = w
        weights[name] = w
    if how == "post_step":  # a mixed record would be worse than none: everything as the step left it
        lost = {}
        for _, name, p in pairs:
            weights[name] = p.detach().to("cpu", copy=True)
            st = _state_copy(optimizer.state.get(p) or {})
            if st:
                state[name] = st
            else:
                state.pop(name, None)
            if id(p) not in names:
                extra[name] = weights[name]
    scale = (step_kwargs or {}).get("grad_scale")
    record = {
        "class": cls,
        "qualname": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "implementation": impl,
        "groups": groups,
        "state": state,
        "gradients": grads,
        "pre_step": how,
        "lost": lost,
        "stand_in": invert.STAND_IN if lost else None,
        "extra_weights": extra,
        "nonfinite_after": {n: c for n, c in after.items() if c["nan"] or c["posinf"] or c["neginf"]},
        "grad_scale": float(scale) if isinstance(scale, torch.Tensor) and scale.numel() == 1 else None,
        "scheduler": scheduler_record(scheduler),
        "notes": notes[:20],
    }
    return record, weights


def weights_set_to(model: nn.Module, weights: dict[str, torch.Tensor]):
    """The module holds `weights` for the duration (recording the step, building the snapshot), swapped in as
    new Parameters; the live ones are put back untouched (capture/owned.py)."""
    return owned.weights_swapped(model, weights)
