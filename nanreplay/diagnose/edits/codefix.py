"""Show a fix as code for *this* site: the user's own line, before and after.

We find the culprit's call on its source line with `ast` and rewrite just that
expression (`d.sqrt()` -> `(d + 1e-12).sqrt()`). The call is matched the way it
ran: by kind (`x ** a` is an operator, `x.pow(a)` a method, `torch.pow(x, a)` a
function), by its literal arguments where the replay knows them (the exponent),
and by its place among the calls of that name on the line. Where the source
cannot be read or the call cannot be found, the caller says the fix is an
op-level patch instead of showing code.

Every read of source text goes through `source_lines()`: the lines the snapshot
recorded around the culprit (`source["context"]`) when there are any, else the
local file. Parsing needs only that window: the smallest statement around the
target line that parses.
"""

from __future__ import annotations

import ast
import linecache
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

# How an operator call is spelled in source: the name torch records for it -> the ast operator. `x / y`
# reaches torch as Tensor.div (the very method `x.div(y)` calls), `x ** a` as Tensor.pow, `1 / x` as
# Tensor.__rdiv__: a method name may be an operator in source, a reflected dunder always is.
_OPERATORS = {"truediv": ast.Div, "div": ast.Div, "true_divide": ast.Div, "divide": ast.Div, "floordiv": ast.FloorDiv,
              "floor_divide": ast.FloorDiv, "pow": ast.Pow, "mul": ast.Mult, "multiply": ast.Mult, "sub": ast.Sub,
              "subtract": ast.Sub, "add": ast.Add, "matmul": ast.MatMult, "mod": ast.Mod, "remainder": ast.Mod}
_MODULE_NAMES = {"torch", "F", "nn", "special", "functional", "linalg"}
_WINDOW = 40  # the most lines a statement may span when looked for in a whole file


@dataclass
class Rewrite:
    before: str  # the whole statement as written
    after: str  # the same statement with the fix applied
    line: int
    operand: str | None = None  # with_operand fixes: the new operand as an expression of `__x` (what is executed)
    file: str | None = None  # the file as the analysis shows it (source["file"])
    first: int | None = None  # the number of `before`'s first line (a statement may start above `line`)
    extra: list[Rewrite] = field(default_factory=list)  # edits of other lines the fix needs (crossline.py)

    def edit(self) -> dict:
        """This rewrite as one entry of a fix's `edits`: {file, line, before, after}."""
        return {"file": self.file, "line": self.first or self.line, "before": self.before, "after": self.after}


# ------------------------------------------------------------------ reading source: one place


def source_lines(source: dict | None) -> tuple[int, list[str]] | None:
    """(number of the first line, the lines) of the source around a culprit, or None.

    The only function in diagnosis that reads source text. `source` is an analysis
    `source` dict; its `context` ({"start": N, "lines": [...]}, recorded at capture
    time) is used when present; otherwise the file at `source["path"]` is read.
    """
    if not source:
        return None
    ctx = source.get("context")
    if isinstance(ctx, dict):
        start, lines = ctx.get("start"), ctx.get("lines")
        if isinstance(start, int) and start >= 1 and isinstance(lines, list) and lines \
                and all(isinstance(x, str) for x in lines):
            return start, [x.rstrip("\r\n") for x in lines]
        return None
    path = source.get("path")
    text = linecache.getlines(path) if isinstance(path, str) and path else []
    return (1, [x.rstrip("\r\n") for x in text]) if text else None


@dataclass
class _Parsed:
    tree: ast.AST
    text: str  # the parsed window, dedented
    first: int  # the absolute number of its first line

    def rel(self, line: int) -> int:
        return line - self.first + 1


def _net_brackets(line: str) -> int:
    """Open minus closed brackets on one line, outside strings and comments (a heuristic)."""
    depth, quote, i = 0, "", 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\":
                i += 1
            elif line.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif ch == "#":
            break
        elif ch in "\"'":
            quote = ch * 3 if line.startswith(ch * 3, i) else ch
            i += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        i += 1
    return depth


def _parse(start: int, lines: list[str], line: int, whole: bool) -> _Parsed | None:
    """The smallest window of `lines` around `line` that parses as statements (a whole file first)."""
    if not (start <= line < start + len(lines)):
        return None
    if whole:
        text = "\n".join(lines) + "\n"
        try:
            return _Parsed(ast.parse(text), text, start)
        except SyntaxError:
            pass
    t = line - start
    net = [_net_brackets(x) for x in lines]
    cont = [x.rstrip().endswith("\\") for x in lines]
    limit = min(len(lines), _WINDOW)
    for size in range(1, limit + 1):
        for lo in range(max(0, t - size + 1), min(t, len(lines) - size) + 1):
            hi = lo + size - 1
            # not in the middle of a statement: the line before opens nothing, the line after closes nothing
            if lo > 0 and (net[lo - 1] > 0 or cont[lo - 1]) or hi + 1 < len(lines) and net[hi + 1] < 0 or cont[hi]:
                continue
            text = textwrap.dedent("\n".join(lines[lo:hi + 1])) + "\n"
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            return _Parsed(tree, text, start + lo)
    return None


# ------------------------------------------------------------------ finding the call that ran


def _kind(call_name: str) -> tuple[str, str]:
    """('operator' | 'method' | 'function' | 'any', the name as spelled) for a recorded call name."""
    owner, _, base = call_name.rpartition(".")
    if base.startswith("__") and base.endswith("__"):
        return "operator", base
    if owner == "Tensor":
        return "method", base
    if owner in ("torch", "F", "torch.ops"):
        return "function", base
    return "any", base


def _operator(name: str) -> tuple[type | None, bool]:
    """'__rtruediv__' -> (ast.Div, in-place?); 'div_' -> (ast.Div, True); 'sqrt' -> (None, False)."""
    core = name.strip("_") if name.startswith("__") else name
    if name.startswith("__") and core[:1] in ("r", "i") and core[1:] in _OPERATORS:
        return _OPERATORS[core[1:]], core[0] == "i"
    if name.endswith("_") and not name.startswith("__") and name[:-1] in _OPERATORS:
        return _OPERATORS[name[:-1]], True
    return _OPERATORS.get(core), False


def _callee(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _is_function_call(node: ast.Call) -> bool:
    """torch.sqrt(x) / F.softmax(x) rather than x.sqrt()."""
    f = node.func
    if isinstance(f, ast.Name):
        return True
    base = f.value if isinstance(f, ast.Attribute) else None
    while isinstance(base, ast.Attribute):
        base = base.value
    return isinstance(base, ast.Name) and base.id in _MODULE_NAMES


def _is_unbound_method(node: ast.Call) -> bool:
    """torch.Tensor.sqrt(x): a method spelled as a function."""
    f = node.func
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "Tensor"


def _matches(node: ast.AST, kind: str, name: str) -> bool:
    """Can `node` be the call torch recorded as `name`, of `kind`? Operators: `x / y` (Tensor.div,
    Tensor.__truediv__, reflected Tensor.__rdiv__) is a BinOp, `x /= y` (Tensor.div_) an AugAssign."""
    op, inplace = _operator(name)
    if op is not None and kind in ("operator", "method", "any"):
        if isinstance(node, ast.AugAssign if inplace else ast.BinOp) and isinstance(node.op, op):
            return True
    if kind == "operator" or not isinstance(node, ast.Call) or _callee(node) != name:
        return False
    if kind == "method":
        return not _is_function_call(node) or _is_unbound_method(node)
    if kind == "function":
        return _is_function_call(node) and not _is_unbound_method(node)
    return True


def _evaluation_order(tree: ast.AST) -> list[ast.AST]:
    """Every node, children before their parent, left to right: the order Python evaluates calls in."""
    out: list[ast.AST] = []

    def visit(n: ast.AST) -> None:
        for child in ast.iter_child_nodes(n):
            visit(child)
        out.append(n)
    visit(tree)
    return out


def _literals(node: ast.AST) -> list[float]:
    """The numeric literals the call is given (`x ** 0.5` -> [0.5], `x.pow(2)` -> [2], `x.sum(-1)` -> [-1])."""
    if isinstance(node, ast.BinOp):
        parts = [node.left, node.right]
    elif isinstance(node, ast.AugAssign):
        parts = [node.value]
    elif isinstance(node, ast.Call):
        parts = list(node.args) + [k.value for k in node.keywords]
    else:
        return []
    out = []
    for p in parts:
        try:
            v = ast.literal_eval(p)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(float(v))
    return out


def find_call(tree: ast.AST, line: int, call_name: str, *, ordinal: tuple[int, int] | None = None,
              scalars: list | None = None) -> list[ast.AST]:
    """The nodes on `line` that can be the recorded call `call_name` ('Tensor.sqrt', 'torch.log',
    'Tensor.__truediv__'), best first.

    `ordinal` = (k, n): the call was the k-th of the n calls of this name that this line made in the
    step; where n is a whole number of executions of the line's matching nodes, the k-th node in
    evaluation order (modulo their number) is the one. `scalars`: numbers the call is known to have
    been given (the exponent); a node with numeric literals none of which is among them is not it.
    """
    kind, name = _kind(call_name)
    order = {id(n): i for i, n in enumerate(_evaluation_order(tree))}
    found = [n for n in ast.walk(tree) if hasattr(n, "lineno") and n.lineno == line and _matches(n, kind, name)]
    if not found:
        found = [n for n in ast.walk(tree) if hasattr(n, "lineno")
                 and n.lineno <= line <= (n.end_lineno or n.lineno) and _matches(n, kind, name)]
    found.sort(key=lambda n: order[id(n)])
    if len(found) > 1 and ordinal is not None:
        k, n = ordinal
        if n % len(found) == 0:
            hit = found[k % len(found)]
            return [hit] + [x for x in found if x is not hit]
    if len(found) > 1 and scalars:
        known = [float(v) for v in scalars if isinstance(v, (int, float)) and not isinstance(v, bool)]
        agree = [x for x in found if not _literals(x) or any(abs(v - s) <= 1e-9 * max(1.0, abs(s))
                                                               for v in _literals(x) for s in known)]
        found = agree + [x for x in found if x not in agree] if agree else found
    return found


def operand(node: ast.AST, which: str) -> ast.AST | None:
    """'input': x in x.sqrt() / torch.sqrt(x) / x ** a / x / y;  'other': y in x / y / x.div(y) / torch.div(x, y)."""
    if isinstance(node, ast.BinOp):
        return node.left if which == "input" else node.right
    if isinstance(node, ast.AugAssign):
        return node.target if which == "input" else node.value
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


def arguments(node: ast.Call) -> list[ast.AST]:
    """The call's positional arguments after its input: `x.sum(-1)` and `torch.sum(x, -1)` both give [-1]."""
    return list(node.args[1:] if _is_function_call(node) else node.args)


# ------------------------------------------------------------------ expressions as text


def _expr(src: str) -> ast.AST | None:
    try:
        return ast.parse(src.strip(), mode="eval").body
    except SyntaxError:
        return None


def paren(src: str) -> str:
    """An expression, parenthesised unless it is already atomic."""
    node = _expr(src)
    if isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)):
        return src
    return f"({src})"


_ADDITIVE_OR_TIGHTER = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.MatMult)


def plus(src: str, rhs: str, op: str = "+") -> str:
    """`src + rhs` (or `src - rhs`), parenthesising `src` only where precedence needs it."""
    node = _expr(src)
    tight = isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant, ast.UnaryOp)) or (
        isinstance(node, ast.BinOp) and isinstance(node.op, _ADDITIVE_OR_TIGHTER))
    return f"{src if tight else f'({src})'} {op} {rhs}"


def functional(source: dict | None) -> str:
    """How the user's code spells torch.nn.functional: `F` when the lines we have use or import it so."""
    got = source_lines(source)
    text = "\n".join(got[1]) if got else ""
    return "F" if "functional as F" in text or re.search(r"(?<![\w.])F\.\w+\(", text) else "torch.nn.functional"


# ------------------------------------------------------------------ locating and rewriting


@dataclass
class Located:
    node: ast.AST
    parsed: _Parsed


def locate(source: dict | None, line: int | None, call_name: str | None, *, ordinal: tuple[int, int] | None = None,
           scalars: list | None = None) -> Located | None:
    """The node of the call `call_name` that ran on `line` of `source`, or None."""
    if not (source and line and call_name):
        return None
    got = source_lines(source)
    if got is None:
        return None
    start, lines = got
    parsed = _parse(start, lines, line, whole=not source.get("context"))
    if parsed is None:
        return None
    nodes = find_call(parsed.tree, parsed.rel(line), call_name, ordinal=ordinal, scalars=scalars)
    return Located(nodes[0], parsed) if nodes else None


def count_calls(source: dict | None, line: int | None, call_name: str | None) -> int:
    """How many expressions on `line` can make the call `call_name` (0: the source cannot be read)."""
    if not (source and line and call_name):
        return 0
    got = source_lines(source)
    parsed = _parse(got[0], got[1], line, whole=not source.get("context")) if got else None
    return len(find_call(parsed.tree, parsed.rel(line), call_name)) if parsed else 0


def literal_argument(source: dict | None, call_name: str | None, name: str, position: int, default=None, *,
                     line: int | None = None, ordinal: tuple[int, int] | None = None):
    """The literal value of argument `name` (or positional `position` after the input) of the call
    `call_name` on the source's line — e.g. the `dim` of `e.sum(-1, keepdim=True)`. `default` where it is
    not passed; None where the source cannot be read or the value is not a literal (a variable)."""
    loc = locate(source, line or (source or {}).get("line"), call_name, ordinal=ordinal)
    node = loc.node if loc else None
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


def rewrite(source: dict | None, line: int | None, call_name: str | None,
            transform: Callable[[Callable[[ast.AST], str], ast.AST], str | None], *,
            ordinal: tuple[int, int] | None = None, scalars: list | None = None) -> Rewrite | None:
    """Rewrite the call `call_name` that ran on `line` of `source`.

    `transform(src, node)` gets `src(n)` (source text of any sub-node) and the call
    node, and returns the new source for the whole call.
    """
    loc = locate(source, line, call_name, ordinal=ordinal, scalars=scalars)
    if loc is None:
        return None
    src = source_of_nodes(loc.parsed)
    try:
        new = transform(src, loc.node)
    except (AttributeError, IndexError, TypeError):
        return None
    if new is None:
        return None
    rw = splice(source, loc, [(loc.node, new)], line)
    rw.operand = getattr(transform, "operand", None)
    return rw


def source_of_nodes(parsed: _Parsed) -> Callable[[ast.AST], str]:
    """`src(node)`: the source text of any node of a parsed window."""
    data = parsed.text.encode()
    starts, pos = [], 0
    for ln in parsed.text.splitlines(keepends=True):
        starts.append(pos)
        pos += len(ln.encode())

    def src(n: ast.AST) -> str:
        return data[starts[n.lineno - 1] + n.col_offset:starts[n.end_lineno - 1] + n.end_col_offset].decode()
    src.starts = starts
    return src


def splice(source: dict, loc: Located, parts: list[tuple[ast.AST, str]], line: int) -> Rewrite:
    """The statement holding `loc.node` with each (node, new text) of `parts` put in its node's place (the nodes
    of one statement, none inside another)."""
    text = loc.parsed.text
    data = text.encode()
    starts = source_of_nodes(loc.parsed).starts
    stmt = _statement(loc.parsed.tree, loc.node) or loc.node
    first, last = stmt.lineno, stmt.end_lineno
    delta = 0
    for node, new in sorted(parts, key=lambda p: (p[0].lineno, p[0].col_offset), reverse=True):
        a = starts[node.lineno - 1] + node.col_offset
        b = starts[node.end_lineno - 1] + node.end_col_offset
        delta += new.count("\n") - data[a:b].decode().count("\n")
        data = data[:a] + new.encode() + data[b:]
    before = "\n".join(text.splitlines()[first - 1:last])
    after = "\n".join(data.decode().splitlines()[first - 1:last + delta])
    return Rewrite(before=_dedent(before), after=_dedent(after), line=line, file=source.get("file"),
                   first=loc.parsed.first + first - 1)


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

PLACEHOLDER = "__x"  # the operand, when a changed operand is executed as written


def with_operand(which: str, change: Callable[[str], str]):
    """A transform that rewrites one operand of the call, keeping the rest as written.

    `change(text)` is also applied to `PLACEHOLDER`: the fix is then verified by executing
    exactly that expression on the operand's value (see `compile_operand`).
    """
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
        if not (is_argument or grouped or isinstance(node, ast.AugAssign)):  # a receiver / operand binds tighter
            new = paren(new)
        return whole[:start] + new + whole[start + len(t):]
    transform.operand = change(PLACEHOLDER)
    return transform


def compile_operand(expression: str) -> Callable | None:
    """`expression` (in terms of `__x`, as shown in the fix) as a function of the operand's value."""
    import math

    import torch

    from nanreplay.replay.frames import _SKIP, _frame_kind

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return None
    # our own templates only: the operand, torch's names, numbers; never a dunder attribute
    if any(isinstance(n, ast.Name) and n.id not in (PLACEHOLDER, "torch", "F", "math") or
           isinstance(n, ast.Attribute) and n.attr.startswith("_") for n in ast.walk(tree)):
        return None
    code = compile(tree, "<nanreplay fix>", "eval")
    _frame_kind[code] = _SKIP  # ops it runs belong to the user's line that made the call, not to this frame
    env = {"torch": torch, "F": torch.nn.functional, "math": math}
    return lambda value: eval(code, env, {PLACEHOLDER: value})  # noqa: S307 - our own template, never user text


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
