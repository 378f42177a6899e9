"""The log of a *selection* of a softmax / sigmoid: `-torch.log(probs.gather(1, a))`, `torch.log(probs[range(n), y])`,
`(probs * F.one_hot(y, C)).sum(-1).log()`, `probs = torch.softmax(logits / T, -1)` on a line above.

A selection copies entries, so the log of a selection is the selection of the log: `log(softmax(x).gather(1, a))`
is `log_softmax(x).gather(1, a)`, exactly, and the one-hot product-sum of a one-hot row picks one entry the same
way. The rules (rules/logs.py: log_softmax, logsigmoid) look through views *and* these selections to the softmax
(`selected`); this module writes the edits and the replay:

* the softmax on the same line: the log call becomes its operand, the softmax call its log form;
* the softmax assigned on a line above in the same block (crossline.Definitions): that assignment makes a new
  name, `log_probs = torch.log_softmax(z, -1)`, and the log's line selects from it. Where anything else may read
  `probs` (sampling, an entropy), the old assignment stays as it was (`z` repeated where it is names and
  arithmetic alone, else `probs = log_probs.exp()`): no other reader changes. A name between them
  (`picked = probs.gather(...)`) is read through: its selection is repeated on the log's line;
* the softmax made in another function (the model's forward, an `nn.Softmax()` in a Sequential): that call
  becomes log_softmax (or the container's child `nn.LogSoftmax(dim)`, construction.py) and the log is dropped,
  only where the step reads the softmax's output for nothing but this log (through views and selections).

The replay (`patch`) remembers the softmax's input, repeats each selection call on the stable form, and answers
the log call with the stable selection: what the edited lines compute.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable

import torch

from nanreplay.diagnose.edits import codefix, construction, crossline, lsmfix
from nanreplay.diagnose.fixes import _LOG_BASE, view_of
from nanreplay.diagnose.site import Site, _passes_through, packet
from nanreplay.replay import OpRecord, frame_json

_SELECTIONS = ("aten.gather", "aten.index_select", "aten.index", "aten.take_along_dim", "aten.masked_select",
               "aten.take")
_ONE_HOT = "aten.one_hot"
_METHODS = {"gather", "index_select", "take_along_dim", "masked_select", "take", "squeeze", "unsqueeze", "view",
            "reshape", "flatten", "narrow", "select", "contiguous", "clone", "t", "transpose", "permute", "diagonal"}
_INNER = {"aten._softmax": "softmax", "aten.softmax": "softmax", "aten.sigmoid": "sigmoid"}


# ------------------------------------------------------------------ the ops: a selection chain back to the softmax


def _is_one_hot_op(s: Site, o: OpRecord) -> bool:
    """F.one_hot, as recorded: aten.one_hot, or (a step program decomposes it) a scatter of a value into zeros."""
    p = packet(str(o.op))
    return p == _ONE_HOT or (p == "aten.scatter" and "value" in str(o.op) and
                             s.origin_packet(0, o) in ("aten.zeros", "aten.zeros_like", "aten.new_zeros"))


def _one_hot_factor(s: Site, mul: OpRecord) -> int | None:
    """The index (0/1) of the factor of `mul` that is NOT F.one_hot(...) (through views, copies, .float()),
    where the other one is; else None."""
    tensors = [i for i in range(len(mul.src)) if mul.src[i] is not None]
    if len(tensors) != 2:
        return None
    for k in (0, 1):
        o = s.origin(tensors[1 - k], mul)
        if o is not None and _is_one_hot_op(s, o):
            return tensors[k]
    return None


def _selections(ops: list[OpRecord]) -> list[OpRecord]:
    """The selections (and a user's ε) among the ops `selected` gives: not the copies."""
    return [r for r in ops if not _passes_through(r)]


def selected(s: Site, rec: OpRecord | None = None) -> tuple[OpRecord, list[OpRecord]] | None:
    """(the softmax/sigmoid, the selection ops from it to the log's input, nearest the log first) where the log's
    input is, through views and copies, a selection (gather, indexing, index_select, take_along_dim,
    masked_select, a one-hot product summed) of a softmax's or sigmoid's output, or that plus a scalar (a user's
    `+ 1e-8` inside the log); None otherwise, or where nothing is in between (the rules' plain case)."""
    rec = rec or s.rec
    sels: list[OpRecord] = []
    r = s.src(0, rec)
    while r is not None:
        p = packet(str(r.op))
        if p in _INNER:
            return (r, sels) if _selections(sels) and r.call else None
        if _passes_through(r) and r.src:
            if not getattr(r.op, "is_view", False):
                sels.append(r)  # a copy (clone, .float()): the replay repeats it on the stable form too
            r = s.src(0, r)
        elif p in _SELECTIONS and r.src and r.src[0] is not None:
            sels.append(r)
            r = s.src(0, r)
        elif p == "aten.add" and not _selections(sels) and len(r.src) == 1 and r.src[0] is not None:
            sels.append(r)  # log(P + 1e-8): a user's ε (a literal, checked where the line is rewritten)
            r = s.src(0, r)
        elif p == "aten.sum" and r.src:
            mul = s.origin(0, r)
            k = _one_hot_factor(s, mul) if mul is not None and packet(str(mul.op)) == "aten.mul" else None
            if k is None:
                return None
            sels += [r, mul]
            r = s.src(k, mul)
        else:
            return None
    return None


def only_selected_by(s: Site, sm: OpRecord, log: OpRecord) -> bool:
    """Does the step read the softmax's output for nothing but this log, through views and selections (and ops
    that read only a shape)? The index a selection takes is its own input, not a reader of the probabilities."""
    todo, seen = [s.index(sm)], set()
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        for j in s.consumers(i):
            r = s.step.ops[j]
            p = packet(str(r.op))
            if r is log or p in lsmfix._SHAPE_ONLY:
                continue
            if _passes_through(r) or (p in _SELECTIONS and tuple(r.src[:1]) == (i,)):
                todo.append(j)
            elif p == "aten.mul" and _one_hot_factor(s, r) is not None and r.src[_one_hot_factor(s, r)] == i:
                todo.append(j)
            elif p == "aten.sum" and tuple(r.src[:1]) == (i,) and packet(str(s.step.ops[i].op)) == "aten.mul":
                todo.append(j)
            else:
                return False
    return True


# ------------------------------------------------------------------ the replay


def patch(inner: OpRecord, sels: list[OpRecord], log: OpRecord, stable: Callable[[tuple, dict], torch.Tensor],
          every: Callable[[int], list[int]] | None = None) -> dict[int, Callable] | None:
    """Patches for log(select(f(x))) -> select(stable(x)): f's call remembers x; each selection call, given (a view
    of) a tracked value, also computes the same selection of its stable counterpart; the log call whose argument is
    (a view of) a tracked selection returns the stable one."""
    calls = [inner.call, log.call] + [r.call for r in sels]
    if not all(calls) or len({inner.call, log.call} | {r.call for r in sels}) < 3:
        return None
    state: dict = {"tracked": []}

    def grab(func, args, kwargs):
        out = func(*args, **kwargs)
        state["tracked"] = [(out, stable(args, kwargs or {}))]
        return out

    def select(func, args, kwargs):
        out = func(*args, **kwargs)
        kwargs = kwargs or {}
        for i, a in enumerate(args):
            for t, st in state["tracked"]:
                v = view_of(st, t, a)
                if v is not None and isinstance(out, torch.Tensor):
                    state["tracked"].append((out, func(*args[:i], v, *args[i + 1:], **kwargs)))
                    return out
        return out

    def answer(func, args, kwargs):
        q = args[0] if args else None
        for t, st in reversed(state["tracked"]):
            v = view_of(st, t, q)
            if v is not None and t is not state["tracked"][0][0]:
                return v * _LOG_BASE[packet(str(log.op))]
        return func(*args, **kwargs)

    def drop_eps(func, args, kwargs):
        out = func(*args, **kwargs)
        for t, st in state["tracked"]:
            v = view_of(st, t, args[0] if args else None)
            if v is not None:
                state["tracked"].append((out, v))  # the exact form has no ε
                break
        return out

    each = every or (lambda c: [c])
    out = {c: grab for c in each(inner.call)}
    out.update({c: drop_eps if packet(str(r.op)) == "aten.add" else select for r in sels for c in each(r.call)})
    out.update({c: answer for c in each(log.call)})
    return out


# ------------------------------------------------------------------ the source: the selection expression


def _sel_base(node: ast.AST, one_hot_names: Callable[[str], bool]) -> ast.AST | None:
    """The expression a selection expression selects from: `X` of X[...], X.gather(...), torch.gather(X, ...),
    (X * oh).sum(d); None where `node` is no selection."""
    if isinstance(node, ast.Subscript):
        return node.value
    if not isinstance(node, ast.Call):
        return None
    name = codefix._callee(node)
    if name == "sum" and not isinstance(node.func, ast.Name):
        prod = codefix.operand(node, "input")
        if isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult):
            for x, oh in ((prod.left, prod.right), (prod.right, prod.left)):
                if _is_one_hot(oh, one_hot_names):
                    return x
        return None
    if name in _METHODS and not isinstance(node.func, ast.Name):  # a bare `gather(...)` is some function of the user's
        return codefix.operand(node, "input")
    return None


def _is_one_hot(node: ast.AST, one_hot_names: Callable[[str], bool]) -> bool:
    while isinstance(node, ast.Call) and codefix._callee(node) in ("float", "to", "type_as", "double", "half"):
        node = node.func.value if isinstance(node.func, ast.Attribute) else None
    if isinstance(node, ast.Name):
        return one_hot_names(node.id)
    return isinstance(node, ast.Call) and codefix._callee(node) == "one_hot"


def _within(src, outer: ast.AST, inner: ast.AST, new: str) -> str:
    """outer's text with inner's (a node inside it) replaced by `new`."""
    st = src.starts

    def at(line, col):
        return st[line - 1] + col
    o = src(outer).encode()
    base = at(outer.lineno, outer.col_offset)
    a, b = at(inner.lineno, inner.col_offset) - base, at(inner.end_lineno, inner.end_col_offset) - base
    return (o[:a] + new.encode() + o[b:]).decode()


def _strip_eps(node: ast.AST) -> ast.AST:
    """`P + 1e-8` -> P: a user's small ε added inside the log is not needed by the exact form."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        for x, c in ((node.left, node.right), (node.right, node.left)):
            if isinstance(c, ast.Constant) and isinstance(c.value, float) and 0 < c.value <= 1e-3:
                return x
    return node


def _log_form(node: ast.Call, src, kind: str, Fn: str) -> str | None:
    """torch.softmax(a, d) / F.softmax / a.softmax(d) -> the same call of log_softmax; torch.sigmoid(a) /
    a.sigmoid() -> Fn.logsigmoid(a)."""
    if kind == "softmax":
        return lsmfix._to_log_softmax(src, node)
    if codefix._callee(node) != "sigmoid" or node.keywords:
        return None
    arg = node.args[0] if codefix._is_function_call(node) and len(node.args) == 1 else (
        node.func.value if not codefix._is_function_call(node) and not node.args else None)
    return f"{Fn}.logsigmoid({src(arg)})" if arg is not None else None


_PURE = (ast.Name, ast.Attribute, ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Load,
         ast.Subscript, ast.Slice, ast.Tuple)


def _pure(node: ast.AST) -> bool:
    """Names, attributes, constants, arithmetic and plain subscripts: evaluating it twice gives the same value
    (no call: no dropout, no module run twice)."""
    return all(isinstance(n, _PURE) for n in ast.walk(node))


class _Builder:
    """The culprit line's new text and the edits of lines above it."""

    def __init__(self, s: Site, kind: str, source: dict, keep: bool = False):
        self.s, self.kind = s, kind
        self.defs = crossline.Definitions(source, source["line"])
        self.Fn = codefix.functional(source)
        self.param: str | None = None  # the name reached that no line of this block assigns (crossline)
        self.keep = keep  # keep every old assignment (the culprit's statement reads the name elsewhere too)
        self.dropped: list[str] = []  # the names whose assignment the edit replaced
        self.note = ""

    def one_hot_name(self, name: str) -> bool:
        d = self.defs.find(name)
        return d is not None and _is_one_hot(d.value, lambda _n: False)

    def expr(self, node: ast.AST, src, depth: int = 0) -> str | None:
        """`node` (a selection of the probabilities) rewritten as the same selection of the log-probabilities."""
        if depth > 4:
            return None
        if isinstance(node, ast.Call) and codefix._callee(node) == self.kind:
            new = _log_form(node, src, self.kind, self.Fn)
            return new
        if isinstance(node, ast.Name):
            return self.name(node.id, depth)
        base = _sel_base(node, self.one_hot_name)
        if base is None:
            return None
        inner = self.expr(base, src, depth + 1)
        return _within(src, node, base, inner) if inner is not None else None

    def name(self, name: str, depth: int) -> str | None:
        d = self.defs.find(name)
        if d is None:
            if self.param is not None:
                return None
            self.param = name  # made elsewhere: the softmax's own line is edited, this name then holds log-probs
            return name
        v = d.value
        if isinstance(v, ast.Call) and codefix._callee(v) == self.kind:
            return self.made_here(d)
        if _sel_base(v, self.one_hot_name) is None:  # `probs = policy(obs)`: the softmax is in the model's forward
            if self.param is not None:
                return None
            self.param = name
            return name
        got = self.expr(v, d.src, depth + 1)
        if got is None:
            return None
        return name if self.param is not None else got  # a selection of a name made elsewhere: its line stays

    def made_here(self, d: crossline.Definition) -> str | None:
        """`probs = torch.softmax(z, -1)` on a line above: a new name for the log form, the old one kept where
        anything else may read it."""
        new = _log_form(d.value, d.src, self.kind, self.Fn)
        if new is None:
            return None
        log_name = self.defs.fresh(f"log_{d.name}" if not d.name.startswith("log") else f"{d.name}_log")
        made = f"{log_name} = {new}"
        if not (d.reused or self.keep):
            self.dropped.append(d.name)
            self.defs.replace(d, [made])
        else:
            arg = codefix.operand(d.value, "input")
            keep = d.statement if arg is not None and _pure(arg) else f"{d.name} = {log_name}.exp()"
            self.defs.replace(d, [d.statement, made] if keep == d.statement else [made, keep])
            self.note = (f"; `{d.name}` stays the {self.kind}'s output for its other readers, and `{log_name}` "
                         f"holds the log-probabilities")
        return log_name


def edits(s: Site, inner: OpRecord, sels: list[OpRecord], kind: str) -> tuple[codefix.Rewrite | None, str]:
    """(the log line's rewrite, carrying the edits of other lines in `extra`, a note for the reasoning); kind is
    "softmax" or "sigmoid"."""
    src = s.source
    if not (src and s.call) or s.library:
        return None, ""
    rw, b = _rewrite(s, sels, kind, src, keep=False)
    if rw is not None and any(re.search(rf"(^|[^\w.]){n}\b", rw.after) for n in b.dropped):
        rw, b = _rewrite(s, sels, kind, src, keep=True)  # the statement reads `probs` elsewhere: keep it made
    if rw is None:
        return None, ""
    if b.param is None:
        return b.defs.attach(rw), b.note
    return _elsewhere(s, inner, sels, kind, rw, b.param)


def _rewrite(s: Site, sels: list[OpRecord], kind: str, src: dict, keep: bool):
    b = _Builder(s, kind, src, keep)

    def transform(text, node):
        if not (isinstance(node, ast.Call) and codefix._callee(node) == "log"):
            return None
        x = codefix.operand(node, "input")
        if x is None:
            return None
        added = packet(str(_selections(sels)[0].op)) == "aten.add"
        if added != (_strip_eps(x) is not x):
            return None  # the recorded add is the line's literal ε, and only then
        x = _strip_eps(x)
        if _sel_base(x, b.one_hot_name) is None and not isinstance(x, ast.Name):
            return None
        return b.expr(x, text)
    return s.rewrite(transform), b


def _elsewhere(s: Site, inner: OpRecord, sels: list[OpRecord], kind: str, rw: codefix.Rewrite,
               name: str) -> tuple[codefix.Rewrite | None, str]:
    """The softmax is made in another function: edit its call (or its container's child) and drop the log."""
    if not only_selected_by(s, inner, s.rec):
        return None, ""
    made = None
    made_at, here = frame_json(inner.frame) or {}, s.source or {}
    if inner.frame is not None and (made_at.get("file"), made_at.get("function")) != (here.get("file"), here.get("function")):
        made = s.rewrite(lambda text, node: _log_form(node, text, kind, codefix.functional(s.source_of(inner.call)))
                         if isinstance(node, ast.Call) else None, inner.call)
    if made is None:
        cls, new = ("Softmax", "LogSoftmax") if kind == "softmax" else ("Sigmoid", "LogSigmoid")
        made = construction.replace_child(getattr(s.subject, "constructions", None), inner, cls, new,
                                           keep_args=True)
    if made is None:
        return None, ""
    rw.extra = [made]
    what = "log_softmax" if kind == "softmax" else "logsigmoid"
    note = (f"; the {kind} at {made.file}:{made.first or made.line} becomes {what}, so `{name}` holds "
            f"log-probabilities: apply .exp() where probabilities are needed (inference, metrics)")
    return rw, note
