"""Is it the kernel, or my math? A fused / backend-specific culprit replayed alone against its reference.

The question arises only when the culprit's forward op is a row of the table (differential/reference.py: the
CPU-flash / flash / efficient / cuDNN attention kernels, the fused norms, addmm, oneDNN's LSTM layer). Then:

1. the culprit's real inputs: the step re-run up to that op (replay/probe.py), its arguments cloned; for a
   backward culprit, on through backward to the op's autograd node, for the gradients that reached it;
2. the node alone, three times: the kernel itself in the step's dtype (does it reproduce here?), the reference
   composition in the step's dtype, and the reference in float64;
3. the verdict: `kernel_differs` (the kernel is non-finite where its reference is finite: the kernel, not your
   math), `reference_agrees` (both non-finite: your math), `not_reproduced` (the kernel alone is finite on these
   inputs); or `skipped` with the reason (the kernel does not run here, no reference for this call, the inputs
   could not be recovered);
4. for `kernel_differs`, the fix — force the reference (sdpa_kernel(SDPBackend.MATH), oneDNN off, the norm
   written out) — verified by a whole-step replay with the reference in place of every call of the kernel.

Cost: one forward to the culprit (plus one backward for a backward culprit), the node three times, and one
whole step for the fix: about one plain replay; all under the analysis's --timeout and memory limit.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nanreplay import stats
from nanreplay import verify as verify_mod
from nanreplay.diagnose.model import Fix
from nanreplay.differential import reference as ref_mod
from nanreplay.enums import FixKind
from nanreplay.errors import raised
from nanreplay.replay.probe import forward_op_call, forward_op_grads

NAME = "kernel"
VERDICTS = ("kernel_differs", "reference_agrees", "not_reproduced", "skipped")


def attach(result: Any, subject: Any, step: Any, c: int | None, *, verify: bool = True) -> None:
    """Where the culprit is a kernel of the table: replay it, put the answer in `result.differential["kernel"]`
    and, where it decides, in the diagnosis. Nothing at all for any other culprit. Without `verify` the fix is
    not replayed (as every other fix then)."""
    ev = step.events[c] if c is not None else None
    op = step.forward_op_of(ev) if ev is not None else None
    row = ref_mod.row_for(op) if op else None
    if row is None or ev.phase not in ("forward", "backward"):
        return
    d = replay_kernel(subject, ev, row, verify=verify)
    result.differential = {**(result.differential or {}), NAME: d}
    _decide(result.diagnosis, d)


def replay_kernel(subject: Any, ev: Any, row: ref_mod.Row, *, verify: bool = True) -> dict:
    t0 = time.perf_counter()
    d = {"question": f"is the fused kernel {_short(row.op)} to blame, or the math it computes? (its reference: "
                     f"{row.name})", "op": row.op, "phase": ev.phase, "reference": row.name,
         "reference_detail": row.reference, "ran": [],
         "verdict": "skipped", "sentence": "", "skipped": None, "fix": None, "seconds": 0.0}
    try:
        _run(subject, ev, row, d, verify)
    except Exception as e:  # noqa: BLE001 - a differential that cannot run is skipped, never a crash
        d["skipped"] = f"the replay raised {raised(e)}"
    if d["skipped"]:
        d["verdict"] = "skipped"
        d["sentence"] = f"The kernel replay did not run: {d['skipped']}."
    d["seconds"] = time.perf_counter() - t0
    return d


def _run(subject: Any, ev: Any, row: ref_mod.Row, d: dict, verify: bool) -> None:
    why = row.why_not()
    if why:
        d["skipped"] = why
        return
    if ev.phase == "backward":
        got = forward_op_grads(subject, ev.fwd, row.op)
        call, grads = got if got is not None else (None, None)
    else:
        call, grads = forward_op_call(subject, ev.fwd, row.op), None
    if call is None:
        d["skipped"] = "the culprit's inputs could not be recovered by re-running the step up to it"
        return
    if ev.phase == "backward" and grads is None:
        d["skipped"] = "no gradient reached the kernel's autograd node when the step was re-run"
        return
    func, args, kwargs = call
    dtype = next((t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()), None)
    where = str(next((t.device for t in _tensors((args, kwargs))), "cpu"))
    label = stats.dtype_name(dtype) if dtype is not None else "?"
    try:
        kernel = _node(lambda a, k: func(*a, **k), args, kwargs, grads, None)
    except Exception as e:  # noqa: BLE001 - e.g. a CUDA kernel replayed on CPU
        d["skipped"] = f"the kernel does not run here ({where}): {raised(e)}"
        return
    n_ref = None

    def reference(a, k):
        got = row.compose(ref_mod.bind(func, a, k))
        if got is None:
            raise _NoReference
        return got

    try:
        ref = _node(reference, args, kwargs, grads, None)
        n_ref = len(ref.outs)
        ref64 = _node(reference, _cast(args), _cast(kwargs), _cast(grads), n_ref)
    except _NoReference:
        d["skipped"] = f"no reference composition for this call of {_short(row.op)} (e.g. a dropout inside it)"
        return
    if grads is None:
        kernel = _Node(kernel.outs[:n_ref])  # the outputs the reference computes (not a logsumexp, a workspace)
    d["ran"] = [kernel.row("kernel", row.op, label, where, ev.phase), ref.row("reference", row.name, label, where, ev.phase),
                ref64.row("reference", row.name, "float64", where, ev.phase)]
    wide = _compare(row.name, ref64.outs, ref.outs)  # the reference computes the maths right (float64, rounding)
    kern = _compare(_short(row.op), ref64.outs, kernel.outs)  # ... and the kernel, where it is finite?
    d["reference_matches_float64"] = wide.ok if wide.elements else None
    d["kernel_matches_float64"] = kern.ok if kern.elements else None  # on the kernel's finite values
    what = "its gradients" if ev.phase == "backward" else "its output"
    if kernel.finite:
        d["verdict"] = "not_reproduced"
        d["sentence"] = (f"Replayed alone on its recorded inputs, {_short(row.op)} is finite here ({label}, {where}): "
                         "the kernel replay does not reproduce the failure, so it says nothing about the kernel.")
    elif ref.finite:
        d["verdict"] = "kernel_differs"
        d["sentence"] = (f"The kernel, not your math: replayed alone on its recorded inputs, {_short(row.op)} makes "
                         f"{kernel.bad()} in {what} ({label}), while its reference composition ({row.name}) "
                         f"is finite on the same inputs in {label}"
                         + (" and in float64" if ref64.finite else "") + "."
                         + ("" if kern.ok else f" Where the kernel is finite it is wrong too: {kern.changed} of its "
                            f"{kern.elements} finite values differ from the float64 reference by up to "
                            f"{kern.worst:.3g} of their scale."))
        d["fix"] = _verify_fix(subject, row, wide) if verify else None
    else:
        d["verdict"] = "reference_agrees"
        d["sentence"] = (f"Your math, not the kernel: {_short(row.op)}'s reference composition ({row.name}) is "
                         f"non-finite on the same recorded inputs too ({label}: {ref.bad()} in {what})"
                         + (f"; in float64 it is finite: a range/precision problem of the computation in {label}, "
                            "which no other kernel fixes." if ref64.finite else
                            ", and in float64 as well: the inputs themselves break the computation."))


class _NoReference(Exception):  # noqa: N818 - not an error: the row's composition does not cover this call
    pass


class _Node:
    """The node alone: its outputs (forward) or the gradients of its inputs (backward), `n` leading outputs."""

    def __init__(self, outs: list[torch.Tensor]):
        self.outs = outs
        self.counts = [stats.counts(t) for t in outs if t.is_floating_point()]

    @property
    def finite(self) -> bool:
        return all(c["nan"] == 0 and c["posinf"] == 0 and c["neginf"] == 0 for c in self.counts)

    def bad(self) -> str:
        nan = sum(c["nan"] for c in self.counts)
        inf = sum(c["posinf"] + c["neginf"] for c in self.counts)
        return " and ".join(p for p in (f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else "") if p) or "no NaN/Inf"

    def row(self, what: str, name: str, dtype: str, where: str, phase: str) -> dict:
        nan = sum(c["nan"] for c in self.counts)
        inf = sum(c["posinf"] + c["neginf"] for c in self.counts)
        return {"what": what, "op": name, "dtype": dtype, "where": where, "alone": True,
                "outputs": "input gradients" if phase == "backward" else "outputs",
                "finite": self.finite, "nan": nan, "inf": inf,
                "loss": None, "loss_finite": None, "grads_finite": self.finite if phase == "backward" else None}


def _node(fn, args: tuple, kwargs: dict, grads: tuple | None, n: int | None) -> _Node:
    """Run `fn` on fresh clones of the recorded arguments: forward alone, or (with the recorded incoming
    `grads`) forward and backward to the arguments' gradients."""
    args, kwargs = _clone(args), _clone(kwargs)
    if grads is None:
        with torch.no_grad():
            out = fn(args, kwargs)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))]
        return _Node([t for t in outs[:n if n is not None else len(outs)] if isinstance(t, torch.Tensor)])
    leaves = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
    for t in leaves:
        t.requires_grad_(True)
    with torch.enable_grad():
        out = fn(args, kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    k = n if n is not None else len(outs)
    pairs = [(o, g) for o, g in zip(outs[:k], grads, strict=False)
             if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    if not pairs:
        return _Node([])
    got = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return _Node([g for g in got if g is not None])


def _compare(name: str, got: list, want: list) -> verify_mod.NoOp:
    """`got` against `want` output by output, wherever `want` is finite, within rounding (verify.NoOp)."""
    out = verify_mod.NoOp()
    for g, w in zip(got, want, strict=False):
        out.compare(name, g, w)
    return out


def _verify_fix(subject: Any, row: ref_mod.Row, wide: verify_mod.NoOp) -> dict:
    """The reference in place of every call of the kernel in the whole step (what forcing the backend does)."""
    modes: list[ref_mod.Substituted] = []

    def forced(variant):
        modes.append(ref_mod.Substituted([row], getattr(variant.model, "current_output_shapes", None)))
        return ref_mod.forcing([row], modes[-1])

    o = verify_mod.try_variant(subject, context=forced,
                               label=f"with {row.name} in place of {_short(row.op)}")
    hits = sum(m.hits.get(row.op, 0) for m in modes)
    applied = hits > 0 or row.user_context is not None
    ok = o.ok and wide.ok and applied
    if not wide.ok:
        why = (f"the reference is not the maths either: at the node, {wide.changed} of {wide.elements} values differ "
               f"from the float64 reference by up to {wide.worst:.3g} of their scale")
    else:
        why = (f"the same maths in another kernel: at the node, equal to the float64 reference on all "
               f"{wide.elements} values, within rounding")
    if not applied:
        verification = "not verified: the replayed step never called the kernel by name"
    elif o.ok:
        verification = f"{o.detail} — {why}" + (f" ({hits} call{'s' if hits != 1 else ''} of the kernel replaced)"
                                              if hits else "")
    else:
        verification = o.detail
    fix = Fix(FixKind.REFERENCE_BACKEND, row.fix, reasoning=f"{row.fix_words}: the step's maths without "
              f"{_short(row.op)}", verified=ok, verification=verification, tested_as="step",
              replay={"loss": o.loss, "grad_norm": o.grad_norm, "plausible": ok if o.ok else False, "why": why
                      if o.ok else "the replay is not finite"})
    return fix.to_json()


def _decide(diagnosis: dict, d: dict) -> None:
    """The kernel verdict in the diagnosis: a verified fix makes it the cause; a kernel that differs without one is
    a sentence. Your math (`reference_agrees`) leaves the diagnosis as the rules made it: that is what it says."""
    if not d.get("sentence") or d["verdict"] != "kernel_differs":
        return
    fix = d.get("fix")
    if d["verdict"] == "kernel_differs" and fix and fix.get("verified"):
        before = {"cause": diagnosis.get("cause"), "title": diagnosis.get("title")}
        diagnosis.update({
            "cause": "kernel_differs",
            "title": f"the kernel, not your math: {_short(d['op'])} breaks where its reference does not",
            "explanation": f"{d['sentence']} Forcing the reference made the whole step finite (verified by "
                           f"replay). Read as the op's own maths, it was: {before['title']}.",
            "fix": fix, "candidates": [fix] + list(diagnosis.get("candidates") or []),
            "replaces": before})
        return
    diagnosis["explanation"] = f"{diagnosis.get('explanation', '')} {d['sentence']}".strip()
    if fix:
        diagnosis["candidates"] = list(diagnosis.get("candidates") or []) + [fix]


# ------------------------------------------------------------------ helpers


def _short(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


def _tensors(x: Any):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _cast(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().double() if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v) for k, v in x.items()}
    return x
