"""log(cosh(x)), the log-cosh regression loss written as its definition (Lightning-AI/torchmetrics#3488): cosh
overflows float32 for a residual above ~89 and the loss is inf. Its exact form (the reformulation table's
`logcosh` row) is logaddexp(x, -x) - log(2), which the domain table's clamp of cosh's input is not: the clamp
caps an outlier's loss and cuts its gradient.
"""

from __future__ import annotations

import math

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.forms import TABLE
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site, packet
from nanreplay.replay import frame_json
from nanreplay.stats import num

aten = torch.ops.aten
ast = codefix.ast
LOG2 = repr(math.log(2))


def _text(src, node) -> str | None:
    """torch.log(torch.cosh(x)) / x.cosh().log() -> (torch.logaddexp(x, -x) - log 2)."""
    if not (isinstance(node, ast.Call) and codefix._callee(node) == "log"):
        return None
    inner = codefix.operand(node, "input")
    if not (isinstance(inner, ast.Call) and codefix._callee(inner) == "cosh"):
        return None
    x = codefix.operand(inner, "input")
    if x is None:
        return None
    t = src(x)
    return f"(torch.logaddexp({t}, -{codefix.paren(t)}) - {LOG2})"


@rule("logcosh", aten.cosh, priority=66)  # before domain_edge's clamp of cosh's input (10)
def _logcosh(s: Site) -> Diagnosis | None:
    if not (s.forward and s.call_is("cosh") and s.event.kind == "inf"):
        return None
    log = next((s.step.ops[i] for i in s.consumers() if packet(str(s.step.ops[i].op)) == "aten.log"), None)
    if log is None or not log.call or log.call == s.call:
        return None
    rw = s.rewrite(_text, log.call)
    state: dict = {}

    def grab(func, args, kwargs):
        state["x"] = args[0]
        return func(*args, **kwargs)

    def stable(func, args, kwargs):
        if "x" not in state:
            return func(*args, **kwargs)
        x = state.pop("x")
        return torch.logaddexp(x, -x) - math.log(2)
    each = s.line_calls if rw is not None else (lambda c: [c])
    patch = {**{c: grab for c in each(s.call)}, **{c: stable for c in each(log.call)}}
    row = TABLE["logcosh"]
    fr = frame_json(log.frame)
    at = f"{fr['file']}:{fr['line']}" if fr else s.where
    return Diagnosis(
        "logcosh", "log(cosh(x)) overflowed: it is logaddexp(x, -x) - log 2",
        f"cosh(x) overflowed {s.dtype} (|x| up to {num(s.inp(0).get('absmax'))}) at {s.where}, and log(Inf) = Inf, "
        f"though log(cosh(x)) is about |x| - log 2 there. torch.logaddexp(x, -x) - log(2) is the same function, "
        "exact for every x; a clamp of x would cap the outlier's loss and cut its gradient.",
        [Fix(row.kind, "", rewrite=rw, patch=patch, reasoning=row.why,
             guidance=f"replace log(cosh(x)) at {at} by torch.logaddexp(x, -x) - math.log(2) of the same x")])
