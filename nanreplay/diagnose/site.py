"""The culprit as rules see it: a `Site` is the culprit event plus its context (op, phase, input
statistics, what produced the op's inputs, what consumed its output, dtype, source line, chain)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from nanreplay.diagnose import codefix
from nanreplay.replay import Event, OpRecord, Step, frame_json


def packet(op: str | None) -> str | None:
    """'aten.sqrt.default' -> 'aten.sqrt'."""
    return op.rsplit(".", 1)[0] if op else None


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
        """Did the user spell the culprit call as one of these (torch.log / Tensor.log / ...)?"""
        base = self.call_name.rsplit(".", 1)[-1]
        return base in names

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
        return f"{at} (module {mod!r})" if mod else f"{at} (the model's own forward)"

    def chain_events(self) -> list[Event]:
        return [self.step.events[i] for i in self.chain]

    def rewrite(self, transform, call_name: str | None = None, line: int | None = None) -> codefix.Rewrite | None:
        """Rewrite the culprit call (or `call_name` on `line`) in the user's source, if it can be read."""
        s = self.source
        if not s:
            return None
        return codefix.rewrite(s["path"], line or s["line"], call_name or self.call_name, transform)


def finite_float(v: Any) -> float | None:
    """A statistic as a finite float, or None (missing, not a number, or not finite)."""
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
