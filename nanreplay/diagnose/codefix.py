"""Show a fix as code for *this* site: the user's own line, before and after.

We find the culprit's call on its source line with `ast` and rewrite just that
expression (`d.sqrt()` -> `(d + 1e-12).sqrt()`). Where the file cannot be read
or the call cannot be found, the caller falls back to a generic snippet.
"""

from __future__ import annotations

import ast
import linecache
from collections.abc import Callable
from dataclasses import dataclass

# Operators a user-level call name may be spelled with in source.
_BINOPS = {"__truediv__": ast.Div, "__rtruediv__": ast.Div, "__rdiv__": ast.Div, "__div__": ast.Div,
           "div": ast.Div, "true_divide": ast.Div,
           "__pow__": ast.Pow, "__rpow__": ast.Pow, "pow": ast.Pow, "__mul__": ast.Mult,
           "__rmul__": ast.Mult, "mul": ast.Mult, "__sub__": ast.Sub, "__rsub__": ast.Sub,
           "__matmul__": ast.MatMult}
_MODULE_NAMES = {"torch", "F", "nn", "special", "functional", "linalg"}


@dataclass
class Rewrite:
    before: str  # the whole statement as written
    after: str  # the same statement with the fix applied
    line: int


def _wanted(call_name: str) -> str:
    return call_name.rsplit(".", 1)[-1]


def find_call(tree: ast.AST, line: int, call_name: str) -> list[ast.AST]:
    """Nodes spanning `line` that spell `call_name` ('Tensor.sqrt', 'torch.log', 'Tensor.__truediv__')."""
    name = _wanted(call_name)
    plain = name.strip("_").removeprefix("r") if name.startswith("__") else name
    found = []
    for node in ast.walk(tree):
        if not hasattr(node, "lineno") or not (node.lineno <= line <= (node.end_lineno or node.lineno)):
            continue
        if isinstance(node, ast.Call):
            f = node.func
            attr = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if attr in (name, plain):
                found.append(node)
        elif isinstance(node, ast.BinOp) and name in _BINOPS and isinstance(node.op, _BINOPS[name]):
            found.append(node)
    found.sort(key=lambda n: (n.lineno != line, n.end_lineno - n.lineno, n.end_col_offset - n.col_offset))
    return found


def _is_function_call(node: ast.Call) -> bool:
    """torch.sqrt(x) / F.softmax(x) rather than x.sqrt()."""
    f = node.func
    if isinstance(f, ast.Name):
        return True
    base = f.value if isinstance(f, ast.Attribute) else None
    while isinstance(base, ast.Attribute):
        base = base.value
    return isinstance(base, ast.Name) and base.id in _MODULE_NAMES


def operand(node: ast.AST, which: str) -> ast.AST | None:
    """'input': x in x.sqrt() / torch.sqrt(x) / x ** a / x / y;  'other': y in x / y / x.div(y) / torch.div(x, y)."""
    if isinstance(node, ast.BinOp):
        return node.left if which == "input" else node.right
    if isinstance(node, ast.Call):
        args = list(node.args)
        if _is_function_call(node):
            idx = 0 if which == "input" else 1
        else:
            if which == "input":
                return node.func.value
            idx = 0
        return args[idx] if len(args) > idx else None
    return None


def _parse(src: str) -> ast.AST | None:
    try:
        return ast.parse(src.strip(), mode="eval").body
    except SyntaxError:
        return None


def paren(src: str) -> str:
    """An expression, parenthesised unless it is already atomic."""
    node = _parse(src)
    if isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)):
        return src
    return f"({src})"


_ADDITIVE_OR_TIGHTER = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.MatMult)


def plus(src: str, rhs: str, op: str = "+") -> str:
    """`src + rhs` (or `src - rhs`), parenthesising `src` only where precedence needs it."""
    node = _parse(src)
    tight = isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant, ast.UnaryOp)) or (
        isinstance(node, ast.BinOp) and isinstance(node.op, _ADDITIVE_OR_TIGHTER))
    return f"{src if tight else f'({src})'} {op} {rhs}"


def functional(path: str | None) -> str:
    """How the user's file spells torch.nn.functional: `F` when it imports it so, else the full name."""
    text = "".join(linecache.getlines(path)) if path else ""
    return "F" if "functional as F" in text else "torch.nn.functional"


def arguments(node: ast.Call) -> list[ast.AST]:
    """The call's positional arguments after its input: `x.sum(-1)` and `torch.sum(x, -1)` both give [-1]."""
    return list(node.args[1:] if _is_function_call(node) else node.args)


def literal_argument(file: str | None, line: int | None, call_name: str | None, name: str, position: int,
                     default=None):
    """The literal value of argument `name` (or positional `position` after the input) of the call
    `call_name` on `file:line` — e.g. the `dim` of `e.sum(-1, keepdim=True)`. `default` where it is not
    passed; None where the source cannot be read or the value is not a literal (a variable)."""
    node = _find(file, line, call_name)
    if not isinstance(node, ast.Call):
        return None
    arg = next((k.value for k in node.keywords if k.arg == name), None)
    if arg is None:
        pos = arguments(node)
        if position >= len(pos):
            return default
        arg = pos[position]
    try:
        return ast.literal_eval(arg)
    except (ValueError, TypeError, SyntaxError):
        return None


def _find(file: str | None, line: int | None, call_name: str | None) -> ast.AST | None:
    if not (file and line and call_name):
        return None
    text = "".join(linecache.getlines(file))
    try:
        tree = ast.parse(text) if text else None
    except SyntaxError:
        return None
    nodes = find_call(tree, line, call_name) if tree else []
    return nodes[0] if nodes else None


def _offset(line_starts: list[int], lineno: int, col: int) -> int:
    return line_starts[lineno - 1] + col


def rewrite(file: str | None, line: int | None, call_name: str | None,
            transform: Callable[[Callable[[ast.AST], str], ast.AST], str]) -> Rewrite | None:
    """Rewrite the call `call_name` on `file:line`.

    `transform(src, node)` gets `src(n)` (source text of any sub-node) and the call
    node, and returns the new source for the whole call.
    """
    if not (file and line and call_name):
        return None
    text = "".join(linecache.getlines(file))
    if not text:
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    nodes = find_call(tree, line, call_name)
    if not nodes:
        return None
    node = nodes[0]
    data = text.encode()
    starts, pos = [], 0
    for ln in text.splitlines(keepends=True):
        starts.append(pos)
        pos += len(ln.encode())

    def src(n: ast.AST) -> str:
        a = _offset(starts, n.lineno, n.col_offset)
        b = _offset(starts, n.end_lineno, n.end_col_offset)
        return data[a:b].decode()

    try:
        new = transform(src, node)
    except (AttributeError, IndexError, TypeError):
        return None
    if new is None:
        return None
    a = _offset(starts, node.lineno, node.col_offset)
    b = _offset(starts, node.end_lineno, node.end_col_offset)
    new_text = (data[:a] + new.encode() + data[b:]).decode()
    stmt = _statement(tree, node) or node
    first, last = stmt.lineno, stmt.end_lineno
    delta = new.count("\n") - src(node).count("\n")
    before = "\n".join(text.splitlines()[first - 1:last])
    after = "\n".join(new_text.splitlines()[first - 1:last + delta])
    return Rewrite(before=_dedent(before), after=_dedent(after), line=line)


def _statement(tree: ast.AST, target: ast.AST) -> ast.stmt | None:
    """The smallest simple statement that holds `target`."""
    best = None
    compound = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.With,
                ast.Try, ast.AsyncFor, ast.AsyncWith)
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(node, compound) \
                and node.lineno <= target.lineno and node.end_lineno >= target.end_lineno:
            if best is None or (node.end_lineno - node.lineno) < (best.end_lineno - best.lineno):
                best = node
    return best


def _dedent(src: str) -> str:
    lines = src.splitlines()
    pad = min((len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()), default=0)
    return "\n".join(ln[pad:] for ln in lines)


# ------------------------------------------------------------------ common transforms


def with_operand(which: str, change: Callable[[str], str]):
    """A transform that rewrites one operand of the call, keeping the rest as written."""
    def transform(src, node):
        target = operand(node, which)
        if target is None:
            return None
        whole = src(node)
        t = src(target)
        # splice by position inside the node's own text
        start = _rel(node, target, whole, src)
        new = change(t)
        is_argument = isinstance(node, ast.Call) and (any(target is a for a in node.args)
                                                      or any(target is k.value for k in node.keywords))
        grouped = 0 < start and whole[start - 1] == "(" and whole[start + len(t):start + len(t) + 1] == ")"
        if not (is_argument or grouped):  # a method receiver or an operator operand binds tighter than `+`
            new = paren(new)
        return whole[:start] + new + whole[start + len(t):]
    return transform


def _rel(node: ast.AST, target: ast.AST, whole: str, src) -> int:
    """Character offset of `target` inside `node`'s source text."""
    if target.lineno == node.lineno:
        prefix_bytes = target.col_offset - node.col_offset
        line_text = whole.splitlines()[0] if whole else ""
        return len(line_text.encode()[:prefix_bytes].decode(errors="ignore"))
    lines = whole.splitlines(keepends=True)
    before = "".join(lines[:target.lineno - node.lineno])
    last = lines[target.lineno - node.lineno]
    return len(before) + len(last.encode()[:target.col_offset].decode(errors="ignore"))
