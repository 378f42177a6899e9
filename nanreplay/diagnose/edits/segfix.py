"""The segment softmax's fix as an edit of the user's exp line (issue 38): `e = scores.exp()` becomes
`e = (scores - scatter(scores.detach(), DST, dim=0, dim_size=n, reduce="max")[DST]).exp()`.

The per-segment maximum is spelled with the user's own segment sum: the `scatter(e, index, ...)` call (torch_geometric's
`scatter`, the form of PyG's first softmax) on the line that divides by it, with `e` replaced by the exp's input
(detached) and `reduce` set to "max", and gathered back the way the user gathers the sum (`[index]`). Only names the
user's lines already use appear; where the division's line holds no such call there is no edit (the fix stays
guidance). The edit is verified by the op-level patch of rules/forms.py, which replays the same arithmetic.
"""

from __future__ import annotations

import ast

from nanreplay.diagnose.edits import codefix

_SUM_REDUCES = ("sum", "add")


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _segment_max_text(src, node: ast.AST, x: str) -> str | None:
    """In the division `node` (e / scatter(e, index, ...)[index]), the per-segment max of `x` in the same spelling."""
    parent = {id(c): p for p in ast.walk(node) for c in ast.iter_child_nodes(p)}
    for call in ast.walk(node):
        if not (isinstance(call, ast.Call) and _callee(call) == "scatter" and len(call.args) >= 2):
            continue
        red = next((k for k in call.keywords if k.arg == "reduce"), None)
        pos_red = call.args[4] if len(call.args) > 4 else None
        red_node = red.value if red is not None else pos_red
        if red_node is not None and not (isinstance(red_node, ast.Constant) and red_node.value in _SUM_REDUCES):
            continue
        if any(isinstance(n, ast.Starred) for n in call.args) or any(k.arg is None for k in call.keywords):
            continue
        if isinstance(node, ast.BinOp) and src(call.args[0]) != src(node.left):
            continue  # not the sum of the numerator (e / scatter(e, ...)[index])
        args = [f"{codefix.paren(x)}.detach()"] + [src(a) for a in call.args[1:4]]
        kws = [f"{k.arg}={src(k.value)}" for k in call.keywords if k.arg != "reduce"]
        new = f"{src(call.func)}({', '.join(args + kws + ['reduce=' + repr('max')])})"
        up = parent.get(id(call))
        if isinstance(up, ast.Subscript) and up.value is call:
            return f"{new}[{src(up.slice)}]"
        if len(call.args) > 2 or any(k.arg == "dim" for k in call.keywords):
            return None  # gathered back some other way along a dim other than 0: no edit we could be sure of
        return f"{new}.index_select(0, {src(call.args[1])})"
    return None


def exp_edit(s, div_call: int) -> codefix.Rewrite | None:
    """The culprit exp's line with each segment's maximum subtracted from its input, or None."""
    src = s.source_of(div_call)
    loc = codefix.locate(src, (src or {}).get("line"), s.spelled(div_call), ordinal=s.ordinal(div_call)) if src else None
    if loc is None:
        return None
    src_text = codefix.source_of_nodes(loc.parsed)

    def transform(text, node):
        x = codefix.operand(node, "input")
        if x is None:
            return None
        m = _segment_max_text(src_text, loc.node, text(x))
        if m is None:
            return None
        return codefix.with_operand("input", lambda t: f"{t} - {m}")(text, node)

    rw = s.rewrite(transform)
    if rw is not None:
        rw.operand = None  # the new operand names the user's variables: verified by the op-level patch, not run
    return rw
