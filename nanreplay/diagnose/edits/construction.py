"""Edit the line that built a module: the fix for a culprit module the user created but a library container calls.

An `nn.Sigmoid()` in `nn.Sequential(...)` runs from torch's frames, so none of its ops has a line of the user's.
The guard records where each Sequential was built (capture/construct.py: the one call in the user's files whose
arguments are calls of exactly the container's children's classes, in order); here the child at the op's module
index is replaced in that statement, `nn.Sigmoid()` -> `nn.Identity()`. Identity rather than removal: the indices of
the later children, and so the state_dict's names, stay as they were.
"""

from __future__ import annotations

import ast

from nanreplay.diagnose.edits import codefix
from nanreplay.replay import OpRecord
from nanreplay.replay.frames import RecordedFrame, frame_json


def _statement(rec: dict) -> tuple[str, ast.Call] | None:
    """(the statement, dedented; the Sequential call in it) of a construction record."""
    start, lines = rec["context"]
    pad = min((len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()), default=0)
    text = "\n".join(ln[pad:] for ln in lines)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    line, col = rec["call"][0] - start + 1, rec["call"][1] - pad
    call = next((n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno == line and n.col_offset == col
                 and codefix._callee(n) == "Sequential"), None)
    return (text, call) if call is not None else None


def replace_child(constructions: list[dict] | None, op: OpRecord, cls: str, new: str, *,
                  keep_args: bool = False) -> codefix.Rewrite | None:
    """The statement that built the Sequential holding the module that ran `op`, with that child (a call of
    `cls`, e.g. Sigmoid) replaced by a call of `new` (Identity) spelled the way the user spelled the class; None
    where the snapshot recorded no such construction. `keep_args`: the child's arguments stay
    (`nn.Softmax(-1)` -> `nn.LogSoftmax(-1)`)."""
    parent, _, idx = (op.module or "").rpartition(".")
    if not idx.isdigit():
        return None
    rec = next((r for r in constructions or [] if r.get("module") == parent), None)
    got = _statement(rec) if rec is not None else None
    if got is None:
        return None
    text, call = got
    i = int(idx)
    if i >= len(call.args) or codefix._callee(call.args[i]) != cls:
        return None
    arg = call.args[i]
    func = arg.func
    args = ", ".join([ast.unparse(a) for a in arg.args] + [f"{k.arg}={ast.unparse(k.value)}" for k in arg.keywords])
    args = args if keep_args else ""
    spelled = f"{ast.unparse(func.value)}.{new}({args})" if isinstance(func, ast.Attribute) else f"torch.nn.{new}({args})"
    lines = text.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))
    a = starts[arg.lineno - 1] + arg.col_offset
    b = starts[arg.end_lineno - 1] + arg.end_col_offset
    after = text[:a] + spelled + text[b:]
    shown = frame_json(RecordedFrame(rec["file"], rec["line"], rec.get("function") or "", rec.get("code"),
                                     tuple(rec["context"]))) or {}
    return codefix.Rewrite(before=text, after=after, line=rec["line"], file=shown.get("file") or rec["file"],
                           first=rec["line"])
