"""Replays that answer "would this change have helped?".

* `try_patch`: replay the step with one call site rewritten (a fix applied at the
  culprit site only) and report whether the loss and every gradient came out
  finite — or which op broke it next.
* `try_variant`: the same for a whole-step change (a model in bf16).
* `precision_probe`: replay the step in other dtypes, uninstrumented.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nanreplay import culprit as culprit_mod
from nanreplay import replay, stats
from nanreplay.rebuild import Subject, compute_loss, to_device
from nanreplay.snapshot import map_tensors


@dataclass
class Outcome:
    ok: bool
    detail: str
    culprit: dict | None = None  # the next culprit, when it did not verify


def _outcome(step: replay.Step) -> Outcome:
    if step.failure is None:
        if step.loss is not None and all(g["nan"] == 0 and g["inf"] == 0 for g in step.grads):
            return Outcome(True, f"replayed with the fix: loss {step.loss:.6g}, every parameter gradient finite")
        return Outcome(False, "replayed with the fix, but the step did not complete")
    ch = culprit_mod.chain(step.events, step.failure.event)
    c = culprit_mod.culprit(step.events, ch)
    what = "the loss" if step.failure.what == "loss" else f"the gradient of {step.failure.name}"
    if c is None:
        return Outcome(False, f"replayed with the fix: {what} is still {step.failure.kind.upper()}")
    ev = step.events[c]
    src = replay.frame_json(step.frame_of(ev))
    where = f" at {src['file']}:{src['line']}" if src else ""
    mod = step.module_of(ev)
    nxt = {"phase": ev.phase, "kind": ev.kind, "op": ev.op, "forward_op": step.forward_op_of(ev),
           "backward_node": ev.node, "module": mod, "source": src}
    return Outcome(False, f"replayed with the fix: {what} is still {step.failure.kind.upper()}; next culprit "
                          f"{ev.op} ({ev.phase}{', ' + ev.node if ev.node else ''}) in module "
                          f"{mod if mod else '<root>'!r}{where}", nxt)


def try_patch(subject: Subject, intercepts: dict[int, Callable]) -> Outcome:
    """Replay with the given call sites rewritten."""
    try:
        step = replay.run_subject(subject, intercepts=intercepts)
    except Exception as e:  # noqa: BLE001 - a fix that breaks the model is a failed fix, not a crash
        return Outcome(False, f"replaying with the fix raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        subject.model.zero_grad(set_to_none=True)
    return _outcome(step)


def _converted(subject: Subject, dtype: torch.dtype | None, autocast: dict | None) -> tuple[Any, Any, Any]:
    """A copy of model and batch in another floating dtype (the original stays untouched)."""
    model = copy.deepcopy(subject.model)
    if dtype is None:
        return model, subject.inputs, subject.target

    def conv(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    model.to(dtype)
    return model, map_tensors(subject.inputs, conv), map_tensors(subject.target, conv)


def try_variant(subject: Subject, *, dtype: torch.dtype | None = None, autocast: dict | None | str = "same",
                label: str = "") -> Outcome:
    """Replay, instrumented, with model and batch converted to `dtype` and/or another autocast setting."""
    model, inputs, target = _converted(subject, dtype, None)
    ac = subject.autocast if autocast == "same" else autocast
    names = {id(m): n for n, m in model.named_modules()}
    try:
        step = replay.run(model, lambda: _call(model, inputs), lambda out: compute_loss(out, target, subject.loss_fn),
                          names=names, prepare=subject.prepare, autocast=ac, site=getattr(model, "site", None))
    except Exception as e:  # noqa: BLE001
        return Outcome(False, f"replaying {label} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    out = _outcome(step)
    out.detail = out.detail.replace("with the fix", label or "with the fix")
    return out


def _call(model, inputs):
    from nanreplay.rebuild import call_model

    return call_model(model, inputs)


def _plain_step(model, inputs, target, subject: Subject, autocast: dict | None) -> dict:
    """One uninstrumented forward+backward: are the loss and gradients finite?"""
    if subject.prepare is not None:
        subject.prepare()
    model.zero_grad(set_to_none=True)
    anomaly_was = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    torch.autograd.set_detect_anomaly(False)
    try:
        with torch.autocast(**autocast) if autocast else _null():
            loss = compute_loss(_call(model, inputs), target, subject.loss_fn)
        if loss.requires_grad:
            loss.backward()
    finally:
        torch.autograd.set_detect_anomaly(*anomaly_was)
    loss_ok = stats.finite_fast(loss.detach())
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not stats.finite_fast(p.grad)]
    return {"loss": stats._num(float(loss.detach().double())), "loss_finite": loss_ok,
            "grads_finite": not bad, "nonfinite_grads": len(bad)}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def precision_probe(subject: Subject, step_dtype: str | None) -> list[dict]:
    """Replay the step in float64 — and in bf16/fp32 where the step ran in fp16 or autocast."""
    plans: list[tuple[str, torch.dtype | None, dict | None]] = []
    ac = subject.autocast
    if ac:
        plans.append(("float32 (autocast off)", torch.float32, None))
        if ac.get("dtype") != torch.bfloat16:
            plans.append(("autocast bfloat16", None, {**ac, "dtype": torch.bfloat16}))
    elif step_dtype == "float16":
        plans += [("bfloat16", torch.bfloat16, None), ("float32", torch.float32, None)]
    elif step_dtype == "bfloat16":
        plans.append(("float32", torch.float32, None))
    plans.append(("float64", torch.float64, None))
    rows = []
    for label, dtype, autocast in plans:
        try:
            model, inputs, target = _converted(subject, dtype, autocast)
            row = _plain_step(model, inputs, target, subject, autocast)
            del model
        except Exception as e:  # noqa: BLE001 - e.g. an op without a float64 kernel on this device
            row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        rows.append({"dtype": label, **row})
    return rows


__all__ = ["Outcome", "try_patch", "try_variant", "precision_probe", "to_device"]
