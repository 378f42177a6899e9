"""Replays that answer "would this change have helped?".

Every replay here runs on an independent copy of the step (`Subject.converted()`): a fix or a probe
never changes the model, the batch or the dtypes of the step being analyzed.

* `try_patch`: replay the step with some call sites rewritten (a fix applied where the user's
  line makes that call) and report whether the loss and every gradient came out finite — or
  which op broke it next — with the replayed loss and gradient norm, for the plausibility check.
* `try_variant`: the same for a whole-step change (a model in bf16).
* `precision_probe`: replay the step in other dtypes, uninstrumented.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanreplay import culprit as culprit_mod
from nanreplay import replay, seeded, stats
from nanreplay import torch_internals as ti
from nanreplay.differential import reference
from nanreplay.errors import raised
from nanreplay.formats.stepmodel import recomputing
from nanreplay.limits import release_memory
from nanreplay.noop import NOOP_RTOL, Float64Reference, NoOp, _tensors, working_rtol  # noqa: F401 - re-exported
from nanreplay.replay.subject import Subject
from nanreplay.replay.upstream import Upstream


@dataclass
class Outcome:
    ok: bool  # the loss and every parameter gradient came out finite
    detail: str
    culprit: dict | None = None  # the next culprit, when it did not verify
    loss: float | None = None  # the replayed loss (unscaled where the step ran with a GradScaler)
    grad_norm: float | None = None  # the total gradient norm (unscaled)
    grad_norms: dict[str, float] | None = None  # per parameter
    noop: NoOp | None = None  # how far the patched calls moved the values the original computed fine
    raised: bool = False  # the replay raised: a fix nanreplay made broke the step's code (a bug, not an answer)


def _checked(intercepts: dict[int, Callable], noop: NoOp) -> dict[int, Callable]:
    """The same patches, each also running the original call on the same inputs and comparing (see NoOp);
    once per call (a fix that did not verify is replayed again, instrumented, with the same calls)."""
    def wrap(c: int, fn):
        def checked(func, args, kwargs):
            out = fn(func, args, kwargs)
            if c not in noop.seen:
                noop.seen.add(c)
                try:
                    with torch.no_grad():
                        want = func(*args, **kwargs)
                    noop.compare(getattr(func, "__name__", str(func)), out, want, c, func, args, kwargs)
                except Exception:  # noqa: BLE001 - the original raising is not the fix's fault; nothing to compare
                    pass
            return out
        return checked
    return {c: wrap(c, fn) for c, fn in intercepts.items()}


def _kind(kind: str) -> str:
    return "NaN" if kind == "nan" else "Inf"  # spelled as everywhere else, not upper-cased


def _outcome(step: replay.Step, k: float = 1.0) -> Outcome:
    if step.failure is None:
        if step.loss is not None and all(g["nan"] == 0 and g["inf"] == 0 for g in step.grads):  # ([] when stopped)
            return Outcome(True, f"replayed with the fix: loss {stats.num(step.loss / k)}, every parameter gradient "
                                 "finite")
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
              label: str = "with the fix", noop: bool = True, compare_at: list[int] | None = None,
              reference: Float64Reference | None = None, shared: Callable[[], Upstream | None] | None = None
              ) -> Outcome:
    """Replay (instrumented, to name the next culprit if it fails) with the given call sites rewritten,
    on an independent copy of the step; with `noop`, each patched call is compared with the original call
    on the same inputs (`Outcome.noop`) — or, with `compare_at`, the outputs of those calls (where a rewritten
    expression ends) with the original step's. `shared()`: the forward up to the first patched call, run once
    for every candidate of the culprit (replay/upstream.py), or None."""
    up = shared() if shared is not None and intercepts else None
    try:
        copy = up.copy if up is not None else subject.converted()
    except Exception as e:  # noqa: BLE001
        return Outcome(False, f"copying the step to replay it {label} raised {raised(e)}", raised=True)
    check = NoOp(rtol=working_rtol(subject), reference=reference) if noop and intercepts else None
    if check is not None and compare_at:
        patched = _at_expression_end(subject, intercepts, compare_at, check, shared)
        if patched is None:
            check = None
        out = _replay(copy, patched or intercepts, label, subject.loss_scale, up, subject)
    else:
        out = _replay(copy, _checked(intercepts, check) if check is not None else intercepts, label,
                      subject.loss_scale, up, subject)
    if check is not None:
        check.settle()  # outside the replay's dispatch mode: autograd runs here
    out.noop = check
    return out


def _at_expression_end(subject: Subject, intercepts: dict[int, Callable], compare_at: list[int], noop: NoOp,
                       shared: Callable[[], Upstream | None] | None = None) -> dict[int, Callable] | None:
    """For a rewrite whose own ops change by design (exp(x - max) is not exp(x)): compare where the rewritten
    expression ends (the softmax's division) instead — the original step's outputs there, from one plain replay,
    against the patched step's. None where the original step cannot be replayed."""
    want: dict[int, object] = {}

    def keep(c):
        def fn(func, args, kwargs):
            out = func(*args, **kwargs)
            if c not in want:
                want[c] = out.detach().clone() if isinstance(out, torch.Tensor) else out
            return out
        return fn
    try:
        up = shared() if shared is not None else None
        replay.run_patched(up.copy if up is not None else subject.converted(), {c: keep(c) for c in compare_at}, up)
    except Exception:  # noqa: BLE001 - no original to compare with: the check is not made, and not claimed
        return None

    def compare(c, fn):
        def checked(func, args, kwargs):
            out = fn(func, args, kwargs) if fn is not None else func(*args, **kwargs)
            if c not in noop.seen and c in want:
                noop.seen.add(c)
                noop.compare(getattr(func, "__name__", str(func)), out, want[c], c, func, args, kwargs, own=False)
            return out
        return checked
    out = dict(intercepts)
    for c in compare_at:
        out[c] = compare(c, intercepts.get(c))
    return out


def _replay(copy: Subject, intercepts: dict[int, Callable] | None, label: str, scale: float | None,
            up: Upstream | None = None, subject: Subject | None = None) -> Outcome:
    release_memory()
    k = scale or 1.0
    try:
        quick = replay.run_patched(copy, intercepts, up)  # no op-level instrumentation: a fix that works costs one step
    except Exception as e:  # noqa: BLE001 - a fix that breaks the model is a failed fix, not a crash
        return Outcome(False, f"replaying {label} raised {raised(e)}", raised=True)
    if quick is None and up is not None:  # the instrumented replay below starts from the first node, on its own copy:
        up.release()                      # the shared part is not held beside it (a later candidate builds it again)
        try:
            copy = subject.converted()
        except Exception as e:  # noqa: BLE001
            return Outcome(False, f"copying the step to replay it {label} raised {raised(e)}", raised=True)
    if quick is not None:
        loss, norms = quick
        out = Outcome(True, f"replayed {label}: loss {stats.num(loss / k)}, every parameter gradient finite",
                      loss=loss / k)  # the loss the loop saw, not the GradScaler's scaled one
        out.grad_norms = {n: v / k for n, v in norms.items()}
        out.grad_norm = math.sqrt(sum(v * v for v in out.grad_norms.values()))
        return out
    try:  # it did not verify: replay it instrumented, to name the op that breaks it now
        step = replay.run_subject(copy, intercepts=intercepts, backward_after_bad_loss=False, stop_at_failure=True)
    except Exception as e:  # noqa: BLE001 - a fix that breaks the model is a failed fix, not a crash
        return Outcome(False, f"replaying {label} raised {raised(e)}", raised=True)
    out = _outcome(step, k)
    out.detail = out.detail.replace("with the fix", label)
    if step.loss is not None and math.isfinite(step.loss):
        out.loss = step.loss / k
    # a failure (the loss, or a gradient) leaves some gradient missing or non-finite: no norms to judge
    norms = {n: replay.grad_norm(p.grad.detach()) / k for n, p in copy.model.named_parameters()
             if p.grad is not None} if step.failure is None else {}
    copy.model.zero_grad(set_to_none=True)
    if norms and all(math.isfinite(v) for v in norms.values()):
        out.grad_norms = norms
        out.grad_norm = math.sqrt(sum(v * v for v in norms.values()))
    return out


def try_variant(subject: Subject, *, dtype: torch.dtype | None = None, autocast: dict | None | str = "same",
                label: str = "", context: Callable[[Subject], contextlib.AbstractContextManager] | None = None
                ) -> Outcome:
    """The whole step with model and batch in `dtype` and/or another autocast setting (an independent copy), and
    under `context(that copy)` where given (a kernel forced to its reference: differential/reference.py)."""
    try:
        variant = subject.converted(dtype, autocast)
    except Exception as e:  # noqa: BLE001
        return Outcome(False, f"converting the step {label} raised {raised(e)}", raised=True)
    with context(variant) if context is not None else contextlib.nullcontext():
        return _replay(variant, None, label or "with the fix", subject.loss_scale)


def plain_step(subject: Subject, *, forward_first: bool = False, stop_at: Culprit | None = None,
               failure: str | None = None) -> dict:
    """One uninstrumented step: are the loss and the gradients finite?

    Stops as soon as the answer is known: a non-finite loss needs no backward
    (`grads_finite` is then None). With forward_first the forward runs under
    no_grad first, so a step that is already non-finite there costs one
    activation at a time instead of the whole graph. With `stop_at` (the culprit
    op), the step stops right after that op when it makes NaN/Inf here too: a
    forward culprit in the forward-alone pass, a backward culprit in backward
    (neither can the gradients its value flows into; the rest of backward is not
    run). What a forward stop means depends on the `failure` of the step as it
    ran: for a loss failure the loss cannot be finite; for a gradient failure
    (the culprit's value was masked before the loss and reached the gradients in
    backward) the gradients cannot be, and the loss was not reached
    (`loss_finite` None). A forward culprit never stops the full pass: a forward
    NaN can be masked before the loss, and that pass answers for the loss.
    """
    if subject.prepare is not None:
        subject.prepare()
    subject.model.zero_grad(set_to_none=True)

    def watch(*phases: str):
        # A forward culprit stops only the forward-alone pass of a loss failure: in a gradient failure the
        # forward NaN may be masked before the loss (the where trap), so the full pass says nothing there.
        return _StopAt(stop_at) if stop_at is not None and stop_at.phase in phases else contextlib.nullcontext()

    with replay.anomaly_off():
        if forward_first:
            try:
                with torch.no_grad(), replay.autocast_from(subject.run_autocast), watch("forward"):
                    loss = subject.loss(subject.forward())
            except _Stopped:
                return forward_stopped(failure)
            if not stats.finite_fast(loss):
                return _row(loss, None)
            if subject.prepare is not None:
                subject.prepare()  # the same RNG for the full pass
        loss = None
        try:
            with watch("backward"):
                with replay.autocast_from(subject.run_autocast):
                    loss = subject.loss(subject.forward())
                if not stats.finite_fast(loss.detach()):
                    return _row(loss, None)
                if loss.requires_grad:
                    loss.backward()
        except _Stopped:
            subject.model.zero_grad(set_to_none=True)
            return {**_row(loss, False), "nonfinite_grads": None,  # not counted: the rest of backward did not run
                    "probe": BACKWARD_STOPPED}
    bad = [n for n, p in subject.model.named_parameters() if p.grad is not None and not stats.finite_fast(p.grad)]
    subject.model.zero_grad(set_to_none=True)
    return {**_row(loss, not bad), "nonfinite_grads": len(bad)}


BACKWARD_STOPPED = "backward stopped after the culprit op, which makes NaN/Inf in this dtype too"


def forward_stopped(failure: str | None) -> dict:
    """The row of a forward culprit that makes NaN/Inf in the probe's dtype too (the rest of the step not run)."""
    if failure == "gradient":
        return {"loss": None, "loss_finite": None, "grads_finite": False, "nonfinite_grads": None,
                "probe": "stopped after the culprit op, which makes NaN/Inf in this dtype too (in the "
                         "step as it ran, its value reached the gradients)"}
    return {"loss": None, "loss_finite": False, "grads_finite": None,
            "probe": "stopped after the culprit op, which makes NaN/Inf in this dtype too"}


class Culprit(NamedTuple):
    """The culprit op as the probe finds it again: its phase, its aten name, and the forward op it is
    (forward) or whose gradient it computes (backward) as that op's name and call number among calls of
    the same op. A call number, not the op's place in the step: under no_grad or checkpointing autograd's
    own ops (the detach of a saved output) are not made, and every later place shifts."""
    phase: str
    op: str
    fwd_op: str
    nth: int
    node: int | None = None  # a step program's node that ran the (forward) op: where seeded runs find it

    @classmethod
    def of(cls, phase: str, fwd: int, op: str, forward_ops: list[str], node: int | None = None) -> Culprit:
        """From the Recorder's numbering: `fwd` is an index into the step's forward ops (`forward_ops`)."""
        return cls(phase, op, forward_ops[fwd], sum(1 for o in forward_ops[:fwd] if o == forward_ops[fwd]), node)


class _Stopped(BaseException):  # noqa: N818 - not an error: the answer is known (BaseException: user code lets it pass)
    pass


class _Tripped(BaseException):  # noqa: N818 - a forward culprit the seeded runs called finite is not, in the whole step
    pass


class _StopAt(ti.TorchDispatchMode):
    """Finds the culprit op again and raises _Stopped (or `stop`) right after it when its output is not finite: a
    forward culprit by its call number, a backward one through the forward call that made its node. Where the
    count does not line up it never stops: only slower, never wrong."""

    def __init__(self, culprit: Culprit, stop: type[BaseException] | None = None):
        super().__init__()
        self.culprit = culprit
        self.stop = stop or _Stopped
        self.calls: dict[str, int] = {}
        self.call_by_seq: dict[int, tuple[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if recomputing() or reference.replacing():  # a checkpointed replay's forward again, inside backward, or a
            return func(*args, **(kwargs or {}))      # reference standing in for a kernel: not the step's ops
        c = self.culprit
        node = ti.current_autograd_node()
        seq = ti.sequence_nr() if node is None else -1
        out = func(*args, **(kwargs or {}))
        if node is None:  # forward (and the loss)
            name = str(func)
            call = (name, self.calls.get(name, 0))
            self.calls[name] = call[1] + 1
            if seq - 1 not in self.call_by_seq:  # the node an op creates takes the number just before it
                self.call_by_seq[seq - 1] = call
            hit = c.phase == "forward" and call == (c.fwd_op, c.nth)
        else:
            hit = c.phase == "backward" and self.call_by_seq.get(ti.node_sequence_nr(node)) == (c.fwd_op, c.nth)
        if hit and str(func) == c.op:
            outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)] \
                if isinstance(out, (list, tuple)) else []
            if not all(stats.finite_fast(t) for t in outs if t.is_floating_point()):
                raise self.stop
        return out


def _row(loss: torch.Tensor, grads_finite: bool | None) -> dict:
    loss_ok = stats.finite_fast(loss.detach())
    return {"loss": stats._num(float(loss.detach().double())), "loss_finite": loss_ok, "grads_finite": grads_finite}


def precision_probe(subject: Subject, step_dtype: str | None, *, failure: str | None = None,
                    culprit: Culprit | None = None) -> list[dict]:
    """Replay the step in float64 — and in bf16/fp32 where the step ran in fp16 or autocast.

    Uninstrumented, one copy at a time. When the snapshot's failure was the loss (a forward problem), each
    dtype first runs forward alone. With the `culprit` op, each run stops right after that op when it makes
    NaN/Inf in the wider dtype too (on inputs computed in that dtype): the answer is known, and the rest of the
    step — the rest of forward, or of backward for a backward culprit — is not run.
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
            row = _probe_one(subject, dtype, autocast, failure, culprit)
        except Exception as e:  # noqa: BLE001 - e.g. an op without a float64 kernel on this device
            row = {"error": raised(e)}
        rows.append({"dtype": label, **row})
    return rows


def _probe_one(subject: Subject, dtype, autocast, failure: str | None, culprit: Culprit | None, *,
               lean: bool = True, seeded_ok: bool = True) -> dict:
    """One dtype of the probe. A gradient failure runs a whole step with grad on in the wider dtype — a
    float64 graph twice the step's — so a step program replays checkpointed (the same values, one more
    forward, a fraction of the memory); where that fails, plainly."""
    variant = subject.converted(dtype, autocast)
    # The forward alone first (under no_grad: one activation at a time) for a loss failure, and for a gradient
    # failure whose culprit is a forward op: if that op makes NaN/Inf in this dtype too, the answer is known
    # without the whole step (a float64 graph, or its checkpointed forward twice)
    forward_first = failure == "loss" or (failure == "gradient" and culprit is not None and culprit.phase == "forward")
    # a kernel with no float64 kernel (oneDNN's LSTM layer) runs as its reference composition in float64
    mode = reference.Substituted(reference.NO_FLOAT64, getattr(variant.model, "current_output_shapes", None)) \
        if dtype == torch.float64 else None
    # ... and where a step program kept its segments' boundaries, the culprit's segment answers first
    seg = seeded.culprit_answer(subject, variant, culprit, mode) \
        if seeded_ok and culprit is not None and (forward_first or failure == "gradient") else None
    if seg is not None and seg[0] == seeded.FAILS:
        row = forward_stopped(failure) if culprit.phase == "forward" else \
            {**_row(seg[2][0], False), "nonfinite_grads": None, "probe": BACKWARD_STOPPED}
        if seg[1] or culprit.phase == "backward":  # (a forward run from node 0 is the forward-alone pass itself)
            row["derived"] = seeded.sentence(seg[1], culprit.phase, seg[2][1] if seg[2] else None)
        if mode is not None and mode.hits:
            row["replaced"] = {op: reference.TABLE[op].reference for op in mode.hits}
        del variant, seg
        release_memory()
        return row
    # a forward culprit FINITE there: straight to the whole step, which must then agree
    tripped, trip = False, seg is not None and culprit.phase == "forward" and forward_first
    checkpointed = getattr(variant.model, "checkpointed", None)  # a step program's StepModule
    lean = lean and failure != "loss" and checkpointed is not None and checkpointed()
    try:
        with mode if mode is not None else contextlib.nullcontext(), \
                _StopAt(culprit, _Tripped) if trip else contextlib.nullcontext():
            row = plain_step(variant, forward_first=forward_first and not trip, stop_at=culprit, failure=failure)
        if mode is not None and mode.hits:
            row["replaced"] = {op: reference.TABLE[op].reference for op in mode.hits}
        return row
    except _Tripped:  # the segment said finite, the whole step says otherwise: the probe as it was decides
        tripped = True
    except Exception:  # noqa: BLE001 - retried without checkpointing, which raises what is real
        if not lean:
            raise
    finally:
        del variant
        release_memory()
    return _probe_one(subject, dtype, autocast, failure, culprit, lean=lean and tripped, seeded_ok=False)
