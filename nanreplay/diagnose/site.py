"""The culprit as rules see it: a `Site` is the culprit event plus its context (op, phase, input
statistics, what produced the op's inputs, what consumed its output, dtype, source line, chain)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.replay import Event, OpRecord, Step, frame_json


def packet(op: str | None) -> str | None:
    """'aten.sqrt.default' -> 'aten.sqrt'; an in-place variant as its op ('aten.log_.default' -> 'aten.log',
    'aten.pow_.Scalar' -> 'aten.pow'): `x.log_()` computes what `x.log()` does, and the rules written for the
    one answer for the other (a dunder such as 'aten.__and__' is not an in-place variant)."""
    if not op:
        return None
    p = op.rsplit(".", 1)[0]
    return p[:-1] if p.endswith("_") and not p.endswith("__") and not p.endswith("._") else p


_COPIES = ("aten.clone", "aten.contiguous", "aten.alias", "aten._to_copy", "aten.lift_fresh")


def _passes_through(rec: OpRecord) -> bool:
    """A view or a plain copy: same values, so rules look through it to the op that computed them."""
    return bool(getattr(rec.op, "is_view", False)) or packet(str(rec.op)) in _COPIES


@dataclass
class Site:
    step: Step
    event: Event
    chain: list[int]
    subject: Any  # rebuild.Subject
    info: dict = field(default_factory=dict)  # the analysis' snapshot_info: history, trigger, environment, ...

    @cached_property
    def rec(self) -> OpRecord | None:
        return self.step.ops[self.event.fwd] if self.event.fwd is not None else None

    @property
    def forward(self) -> bool:
        return self.event.phase == "forward"

    @property
    def fwd_op(self) -> str | None:
        return str(self.rec.op) if self.rec else None

    @property
    def packet(self) -> str | None:
        return packet(self.fwd_op)

    @property
    def op_packet(self) -> str:
        return packet(self.event.op)

    @property
    def inputs(self) -> list[dict]:
        return self.event.inputs or []

    def inp(self, i: int) -> dict:
        return self.inputs[i] if i < len(self.inputs) else {}

    @property
    def dtype(self) -> str:
        for st in self.inputs:
            if st.get("dtype", "").startswith(("float", "bfloat")):
                return st["dtype"]
        return "float32"

    @property
    def finfo(self) -> torch.finfo:
        return torch.finfo(getattr(torch, self.dtype))

    @property
    def call(self) -> int:
        return self.step.call_of(self.event)

    @property
    def call_name(self) -> str:
        c = self.call
        return self.step.call_names[c] if 0 < c < len(self.step.call_names) else ""

    def call_is(self, *names: str) -> bool:
        """Did the user spell the culprit call as one of these (torch.log / Tensor.log / ...)? An in-place
        method (`x.log_()`, `x.div_(y)`) is its op's spelling too."""
        base = self.call_name.rsplit(".", 1)[-1]
        return base in names or (base.endswith("_") and not base.endswith("__") and base[:-1] in names)

    def src(self, i: int, rec: OpRecord | None = None) -> OpRecord | None:
        """The forward op that produced the i-th tensor input of `rec` (default: the culprit's forward op)."""
        rec = rec or self.rec
        if rec is None or i >= len(rec.src) or rec.src[i] is None:
            return None
        return self.step.ops[rec.src[i]]

    def origin(self, i: int, rec: OpRecord | None = None) -> OpRecord | None:
        """Like src(), looking through views and copies (squeeze, view, clone, ...) to the op that computed it."""
        r = self.src(i, rec)
        while r is not None and _passes_through(r) and r.src:
            r = self.src(0, r)
        return r

    def leaf(self, i: int, rec: OpRecord | None = None) -> tuple[str, str] | None:
        """(kind, name) when the i-th tensor input of `rec` (default: the culprit's forward op) is, through views
        and copies, a batch tensor ("input"/"target") or a parameter; None when an op computed it."""
        rec = rec or self.rec
        while rec is not None and i < len(rec.src):
            if rec.src[i] is None:
                return rec.leaves[i] if rec.leaves and i < len(rec.leaves) else None
            r = self.step.ops[rec.src[i]]
            if not (_passes_through(r) and r.src):
                return None
            rec, i = r, 0
        return None

    def origin_packet(self, i: int, rec: OpRecord | None = None) -> str | None:
        r = self.origin(i, rec)
        return packet(str(r.op)) if r else None

    def index(self, rec: OpRecord) -> int:
        return next(i for i, r in enumerate(self.step.ops) if r is rec)

    def consumers(self, fwd: int | None = None) -> list[int]:
        """Forward ops that took the output of forward op `fwd` (default: the culprit's) as input."""
        fwd = self.event.fwd if fwd is None else fwd
        return [i for i, r in enumerate(self.step.ops) if fwd in r.src]

    def consumer_packets(self, fwd: int | None = None) -> list[str]:
        return [packet(str(self.step.ops[i].op)) for i in self.consumers(fwd)]

    @property
    def frame(self) -> tuple | None:
        return self.step.frame_of(self.event)

    @property
    def source(self) -> dict | None:
        return frame_json(self.frame)

    @property
    def where(self) -> str:
        s = self.source
        mod = self.step.module_of(self.event)
        at = f"{s['file']}:{s['line']}" if s else f"{self.call_name or self.event.op} (no source line)"
        lib = library_of(s.get("recorded_path") or s.get("file") or "") if s else None
        inside = f", inside {lib}" if lib else ""
        if mod and mod != "<loss>":
            return f"{at} (module {mod!r}{inside})"
        step_fn = getattr(self.subject, "input_label", None) == "batch"  # the recorded call is a step_fn, not forward
        return f"{at} ({ran_in(mod, s, step_fn=step_fn)}{inside})"

    @property
    def library(self) -> str | None:
        """The package whose code made the culprit call (transformers, torch, ...), where it is library code
        (site-packages, dist-packages, torch itself) rather than the user's: its line is not the user's to edit."""
        s = self.source
        return library_of(s.get("recorded_path") or s.get("file") or "") if s else None

    @property
    def made_where(self) -> str:
        """Where the value was made: the culprit's line; in library code from the package down
        ('transformers/loss/loss_utils.py:47')."""
        s = self.source
        if not s:
            return self.call_name or self.event.op
        path = (s.get("recorded_path") or s.get("file") or "").replace("\\", "/")
        for m in ("/site-packages/", "/dist-packages/"):
            if m in path:
                path = path.split(m, 1)[1]
        return f"{path if self.library else s['file']}:{s['line']}"

    def chain_events(self) -> list[Event]:
        return [self.step.events[i] for i in self.chain]

    # ---- the call as it ran: its line, and every call of the same expression on that line

    @cached_property
    def _call_frames(self) -> dict[int, tuple]:
        """call number -> the user's frame it ran in (forward calls, and Python calls made during backward)."""
        out: dict[int, tuple] = {}
        for r in self.step.ops:
            if r.call and r.frame is not None and r.call not in out:
                out[r.call] = r.frame
        for e in self.step.events:
            if e.call and e.frame is not None and e.call not in out:
                out[e.call] = e.frame
        return out

    def name_of(self, call: int) -> str:
        return self.step.call_names[call] if 0 < call < len(self.step.call_names) else ""

    def same_site(self, call: int) -> list[int]:
        """Every call of the same name made from the same source line, in order (one per execution and node)."""
        fr = self._call_frames.get(call)
        if fr is None:
            return [call]
        name = self.name_of(call)
        return sorted(c for c, f in self._call_frames.items() if f[:2] == fr[:2] and self.name_of(c) == name)

    def ordinal(self, call: int) -> tuple[int, int]:
        """(k, n): `call` was the k-th of the n calls of its name that its line made in this step."""
        calls = self.same_site(call)
        return (calls.index(call) if call in calls else 0), len(calls)

    def source_of(self, call: int) -> dict | None:
        return frame_json(self._call_frames.get(call))

    def spelled(self, call: int) -> str:
        """The call's name as the line spells it: the recorded name, or where the line holds no call of that name
        (a step program records aten ops: `nll_loss_forward` ran inside `F.cross_entropy`) the user's call."""
        name, user = self.name_of(call), self.step.user_call(call)
        src = self.source_of(call)
        if user and user != name and src and not codefix.count_calls(src, src["line"], name):
            return user
        return name

    def line_calls(self, call: int) -> list[int]:
        """The calls the same expression made in every execution of its line (each transformer block, each
        loop iteration), where the line's source tells how many such expressions it holds; else just `call`."""
        src = self.source_of(call)
        k, n = self.ordinal(call)
        m = codefix.count_calls(src, src["line"], self.spelled(call)) if src else 0
        if not m or n % m:
            return [call]
        calls = self.same_site(call)
        return [c for i, c in enumerate(calls) if i % m == k % m]

    def at_calls(self, fn: Callable, call: int | None = None, rewrite: codefix.Rewrite | None = None) -> dict | None:
        """The patch for a fix: `fn` at every call of the rewritten expression when the fix is a change of the
        user's line; at the culprit's call alone (an op-level patch) when there is no line to change."""
        call = self.call if call is None else call
        if not call:
            return None
        return {c: fn for c in (self.line_calls(call) if rewrite is not None else [call])}

    def rewrite(self, transform, call: int | None = None, *, scalars: list | None = None) -> codefix.Rewrite | None:
        """Rewrite the culprit call (or call number `call`) in the user's source, if it can be read."""
        call = self.call if call is None else call
        src = self.source if call == self.call else self.source_of(call)
        if not src or not call or library_of(src.get("recorded_path") or src.get("file") or ""):
            return None  # library code (site-packages, torch) is not the user's to edit: an op-level patch instead
        if scalars is None and call == self.call and self.forward:
            scalars = [v for v in self.event.scalars or [] if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return codefix.rewrite(src, src["line"], self.spelled(call), transform, ordinal=self.ordinal(call),
                               scalars=scalars)


def finite_float(v: Any) -> float | None:
    """A statistic as a finite float, or None (missing, not a number, or not finite)."""
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "\\site-packages\\", "\\dist-packages\\")


def library_of(path: str) -> str | None:
    """'…/site-packages/transformers/loss/loss_utils.py' -> 'transformers'; torch's own files -> 'torch'; else None."""
    p = path.replace("\\", "/")
    for m in ("/site-packages/", "/dist-packages/"):
        if m in p:
            return p.split(m, 1)[1].split("/", 1)[0] or "a library"
    if "/torch/" in p and p.rsplit("/torch/", 1)[0].endswith(("lib/python3", "python3")):
        return "torch"
    return None


def ran_in(module: str | None, src: dict | None, *, step_fn: bool = False) -> str:
    """Where an op outside every submodule ran, in words: the model's own forward, a helper function it called, the
    loss function, or the user's loss/step code (a `training_step`, `compute_loss`, a step function), told by the
    function it ran in. Outside the loss, with no step_fn recorded, the call recorded is the model's forward, so
    a function other than `forward` that ran there (module "") was called by it: it is the model's code."""
    fn = (src or {}).get("function") or ""
    if module == "<loss>" and (not fn or fn == "<module>"):
        return "the loss function"
    if module != "<loss>" and (not fn or fn == "forward"):
        return "the model's own forward"
    if module == "" and not step_fn and fn != "<module>":
        return f"in {fn}(), a function the model's own forward called"
    return f"in {fn}(), the loss/step code outside the model's modules"
