"""Replays that answer "would this change have helped?".

* `try_patch`: replay the step with one call site rewritten (a fix applied at the
  culprit site only) and report whether the loss and every gradient came out
  finite — or which op broke it next.
* `try_variant`: the same for a whole-step change (a model in bf16).
* `precision_probe`: replay the step in other dtypes, uninstrumented.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanreplay import culprit as culprit_mod
from nanreplay import replay, stats
from nanreplay.errors import first_line
from nanreplay.replay.subject import Subject


@dataclass
class Outcome:
    ok: bool
    detail: str
    culprit: dict | None = None  # the next culprit, when it did not verify


def _kind(kind: str) -> str:
    return "NaN" if kind == "nan" else "Inf"  # spelled as everywhere else, not upper-cased


def _outcome(step: replay.Step) -> Outcome:
    if step.failure is None:
        if step.loss is not None and all(g["nan"] == 0 and g["inf"] == 0 for g in step.grads):
            return Outcome(True, f"replayed with the fix: loss {step.loss:.6g}, every parameter gradient finite")
        return Outcome(False, "replayed with the fix, but the step did not complete")
    ch = culprit_mod.chain(step.events, step.failure.event)
    c = culprit_mod.culprit(step.events, ch)
    what = "the loss" if step.failure.what == "loss" else f"the gradient of {step.failure.name}"
    if c is None:
        return Outcome(False, f"replayed with the fix: {what} is still {_kind(step.failure.kind)}")
    ev = step.events[c]
    src = replay.frame_json(step.frame_of(ev))
    where = f" at {src['file']}:{src['line']}" if src else ""
    mod = step.module_of(ev)
    nxt = {"phase": ev.phase, "kind": ev.kind, "op": ev.op, "forward_op": step.forward_op_of(ev),
           "backward_node": ev.node, "module": mod, "source": src}
    return Outcome(False, f"replayed with the fix: {what} is still {_kind(step.failure.kind)}; next culprit "
                          f"{ev.op} ({ev.phase}{', ' + ev.node if ev.node else ''}) "
                          f"{f'in module {mod!r}' if mod else 'in the model itself'}{where}", nxt)


def try_patch(subject: Subject, intercepts: dict[int, Callable] | None = None, *,
              label: str = "with the fix") -> Outcome:
    """Replay (instrumented, to name the next culprit if it fails) with the given call sites rewritten."""
    try:
        step = replay.run_subject(subject, intercepts=intercepts, backward_after_bad_loss=False)
    except Exception as e:  # noqa: BLE001 - a fix that breaks the model is a failed fix, not a crash
        return Outcome(False, f"replaying {label} raised {type(e).__name__}: {first_line(e)}")
    finally:
        subject.model.zero_grad(set_to_none=True)
    out = _outcome(step)
    out.detail = out.detail.replace("with the fix", label)
    return out


def try_variant(subject: Subject, *, dtype: torch.dtype | None = None, autocast: dict | None | str = "same",
                label: str = "") -> Outcome:
    """The whole step with model and batch in `dtype` and/or another autocast setting."""
    try:
        variant = subject.converted(dtype, autocast)
    except Exception as e:  # noqa: BLE001
        return Outcome(False, f"converting the step {label} raised {type(e).__name__}: {first_line(e)}")
    return try_patch(variant, label=label or "with the fix")


def plain_step(subject: Subject, *, forward_first: bool = False) -> dict:
    """One uninstrumented step: are the loss and the gradients finite?

    Stops as soon as the answer is known: a non-finite loss needs no backward
    (`grads_finite` is then None). With forward_first the forward runs under
    no_grad first, so a step that is already non-finite there costs one
    activation at a time instead of the whole graph.
    """
    if subject.prepare is not None:
        subject.prepare()
    subject.model.zero_grad(set_to_none=True)
    with replay.anomaly_off():
        if forward_first:
            with torch.no_grad(), replay.autocast_from(subject.run_autocast):
                loss = subject.loss(subject.forward())
            if not stats.finite_fast(loss):
                return _row(loss, None)
            if subject.prepare is not None:
                subject.prepare()  # the same RNG for the full pass
        with replay.autocast_from(subject.run_autocast):
            loss = subject.loss(subject.forward())
        if not stats.finite_fast(loss.detach()):
            return _row(loss, None)
        if loss.requires_grad:
            loss.backward()
    bad = [n for n, p in subject.model.named_parameters() if p.grad is not None and not stats.finite_fast(p.grad)]
    subject.model.zero_grad(set_to_none=True)
    return {**_row(loss, not bad), "nonfinite_grads": len(bad)}


def _row(loss: torch.Tensor, grads_finite: bool | None) -> dict:
    loss_ok = stats.finite_fast(loss.detach())
    return {"loss": stats._num(float(loss.detach().double())), "loss_finite": loss_ok, "grads_finite": grads_finite}


def precision_probe(subject: Subject, step_dtype: str | None, *, failure: str | None = None) -> list[dict]:
    """Replay the step in float64 — and in bf16/fp32 where the step ran in fp16 or autocast.

    Uninstrumented, one copy at a time. When the snapshot's failure was the loss
    (a forward problem), each dtype first runs forward alone.
    """
    plans: list[tuple[str, torch.dtype | None, dict | None | str]] = []
    ac = subject.autocast
    if ac:
        plans.append(("float32 (autocast off)", torch.float32, None))
        if ac.get("dtype") != torch.bfloat16:
            plans.append(("autocast bfloat16", None, {**ac, "dtype": torch.bfloat16}))
    elif step_dtype == "float16":
        plans += [("bfloat16", torch.bfloat16, "same"), ("float32", torch.float32, "same")]
    elif step_dtype == "bfloat16":
        plans.append(("float32", torch.float32, "same"))
    plans.append(("float64", torch.float64, None if ac else "same"))
    rows = []
    for label, dtype, autocast in plans:
        try:
            variant = subject.converted(dtype, autocast)
            row = plain_step(variant, forward_first=failure == "loss")
            del variant
        except Exception as e:  # noqa: BLE001 - e.g. an op without a float64 kernel on this device
            row = {"error": f"{type(e).__name__}: {first_line(e)}"}
        rows.append({"dtype": label, **row})
    return rows
