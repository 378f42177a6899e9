"""A float16 product that overflows on its way to a softmax (attention scores): computed in float32, as an edit.

A model cast to float16 by the code itself (`model.half()`, no autocast) whose `q @ k^T` exceeds 65504 makes Inf
scores, and the softmax of an Inf row is NaN. Scaling q by d**-0.5 before the product only divides the scores by
sqrt(d); when they exceed float16's range after that too, the scores themselves do not fit float16. The fix that
matches the code is the one attention kernels make: the product's operands cast to float32 on the culprit's line,
the float32 scores carried through what follows (a scale, a mask) to the softmax, and the softmax's output, in
[0, 1], cast back to float16 on its own line, so everything after it runs as before. Two edits when the softmax is
on another line (crossline.py's contract: `Fix.edits`); the replay runs exactly them: the product's float16
operands made float32 at every call of its line, the softmax's output made float16 at every call of its line.
Under autocast this does not apply (autocast would cast the operands straight back): bfloat16 autocast is the fix.
"""

from __future__ import annotations

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.model import Fix
from nanreplay.diagnose.site import Site, packet
from nanreplay.enums import FixKind
from nanreplay.replay import OpRecord, frame_json

ast = codefix.ast
_PRODUCTS = ("aten.bmm", "aten.mm", "aten.matmul", "aten.baddbmm", "aten.addmm")
_SOFTMAX = ("aten._softmax", "aten.softmax")
_BETWEEN = ("aten.div", "aten.mul", "aten.add", "aten.sub", "aten.masked_fill", "aten.where", "aten.clone",
            "aten.contiguous", "aten._unsafe_view", "aten.view", "aten.reshape", "aten.expand", "aten.unsqueeze",
            "aten.squeeze")


def _softmax_after(s: Site) -> OpRecord | None:
    """The softmax the culprit's output reaches through a scale, a mask, a view (each taking it alone), or None."""
    at = s.event.fwd
    for _ in range(6):
        nxt = s.consumers(at)
        if len(nxt) != 1:
            return None
        r = s.step.ops[nxt[0]]
        if packet(str(r.op)) in _SOFTMAX:
            return r
        if packet(str(r.op)) not in _BETWEEN:
            return None
        at = nxt[0]
    return None


def _operands_float(src, node) -> str | None:
    """torch.matmul(a, b) / torch.bmm(a, b) / a.matmul(b) / a @ b -> the same with a.float() and b.float()."""
    def f(n) -> str:
        return f"{codefix.paren(src(n))}.float()"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return f"{f(node.left)} @ {f(node.right)}"
    if not isinstance(node, ast.Call) or node.keywords:
        return None
    if codefix._is_function_call(node) and len(node.args) == 2:
        return f"{src(node.func)}({f(node.args[0])}, {f(node.args[1])})"
    if not codefix._is_function_call(node) and len(node.args) == 1:
        return f"{f(node.func.value)}.{node.func.attr}({f(node.args[0])})"
    return None


def _up(func, args, kwargs):
    return func(*[a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.float16 else a for a in args],
                **kwargs)


def _down(func, args, kwargs):
    return func(*args, **kwargs).to(torch.float16)


def float32_scores(s: Site) -> Fix | None:
    """The overflowing float16 product computed in float32 up to the softmax it feeds, as two edits of the user's
    lines (None where the code is not that shape, the lines cannot be read, or autocast ran)."""
    if s.subject.autocast or not s.forward or s.packet not in _PRODUCTS or s.dtype != "float16":
        return None
    sm = _softmax_after(s)
    if sm is None or not sm.call:
        return None
    here, there = s.source, frame_json(sm.frame)
    if not here or not there or (here["file"], here["line"]) == (there["file"], there["line"]):
        return None  # one line holds both: not rewritten here (its edits would overlap)
    rw = s.rewrite(_operands_float)
    down = s.rewrite(lambda src, node: f"{src(node)}.to(torch.float16)", sm.call)
    if rw is None or down is None:
        return None
    rw.extra = [down]
    patch = {c: _up for c in s.line_calls(s.call)}
    patch.update({c: _down for c in s.line_calls(sm.call)})
    return Fix(FixKind.FLOAT32_SOFTMAX, "", rewrite=rw, patch=patch,
               reasoning=f"float16's largest value is {torch.finfo(torch.float16).max:.0f}; the product's operands "
                         f"in float32 keep every score finite through to the softmax at {there['file']}:"
                         f"{there['line']}, whose output (in [0, 1]) goes back to float16, so the rest of the model "
                         "runs in float16 as before — what attention kernels do")
