"""A remedy in the data written as an edit: leave the bad rows out of the batch where it enters the code.

Some failures have no code fix: a NaN sample in the batch, an all-zero reference clip whose SI-SDR is undefined.
The root is in the data (which row is reported), and the stopgap is a row filter on the user's own line, placed
before the statement that first reads the rows:

    keep = (ref ** 2).sum(-1) > 0
    est, ref = est[keep], ref[keep]
    alpha = (est * ref).sum(-1, keepdim=True) / (ref ** 2).sum(-1, keepdim=True)

`keep` is all True on a healthy batch, so indexing with it copies every row unchanged and the step computes
what it computed before; on the bad batch the rows it drops are the ones the analysis named. Every name the
statement reads per row is filtered the same way (the caller checks their leading dimension where it can).
"""

from __future__ import annotations

import re

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.replay.frames import RecordedFrame, frame_json

ast = codefix.ast
_NOT_ROWS = codefix._MODULE_NAMES | {"self", "math", "np", "numpy", "True", "False", "None"}


def read_names(stmt: ast.stmt) -> list[str]:
    """The names a statement reads as values, in order of first use: not the modules it calls through
    (`torch.log`, `F.mse_loss`), not functions it calls by name, not the names it assigns. A tensor whose methods
    it calls (`ref.pow(2)`) is read."""
    called = {id(n.func) for n in ast.walk(stmt) if isinstance(n, ast.Call)}
    out: list[str] = []
    for n in sorted((n for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)),
                    key=lambda n: (n.lineno, n.col_offset)):
        if id(n) in called or n.id in _NOT_ROWS or n.id in out:
            continue
        out.append(n.id)
    return out


def rows_read_from(source: dict | None, line: int | None) -> list[str] | None:
    """The names the statement at `line` and the rest of its block (as far as the recorded lines go) read before
    assigning them: every value that must lose the same rows for what follows to line up. None where the lines
    cannot be read."""
    got = statement_at(source, line)
    if got is None:
        return None
    parsed, stmt = got
    lines = codefix.source_lines(source)[1]
    first = parsed.first + stmt.lineno - 1  # the statement's absolute line
    start = codefix.source_lines(source)[0]
    block = lines[first - start:]
    pad = len(block[0]) - len(block[0].lstrip())
    end = next((i for i, ln in enumerate(block) if i and ln.strip() and len(ln) - len(ln.lstrip()) < pad), len(block))
    block = [ln[pad:] if ln.strip() else "" for ln in block[:end]]
    tree = None
    for n in range(len(block), 0, -1):  # the longest prefix that parses (the recorded lines may stop mid-statement)
        try:
            tree = ast.parse("\n".join(block[:n]))
            break
        except SyntaxError:
            continue
    if tree is None or not tree.body:
        return None
    out: list[str] = []
    assigned: set[str] = set()
    for st in tree.body:
        for name in read_names(st):
            if name not in assigned and name not in out:
                out.append(name)
        assigned |= {n.id for n in ast.walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        if isinstance(st, (ast.Return, ast.Raise)):
            break
    return [n for n in out if not n.isupper()]


def keep_name(taken: set[str]) -> str:
    name, i = "keep", 2
    while name in taken:
        name, i = f"keep{i}", i + 1
    return name


def filter_lines(keep: str, keep_expr: str, names: list[str], why: str) -> list[str]:
    """`keep = <expr>  # why` then `a, b = a[keep], b[keep]`."""
    lhs = ", ".join(names)
    rhs = ", ".join(f"{n}[{keep}]" for n in names)
    return [f"{keep} = {keep_expr}  # {why}", f"{lhs} = {rhs}"]


_COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.With, ast.Try)


def statement_at(source: dict | None, line: int | None):
    """(the parsed window, the smallest simple statement that holds `line`), or None."""
    got = codefix.source_lines(source) if line else None
    if got is None:
        return None
    parsed = codefix._parse(got[0], got[1], line, whole=not source.get("context"))
    if parsed is None:
        return None
    rel = parsed.rel(line)
    best = None
    for n in ast.walk(parsed.tree):
        if isinstance(n, ast.stmt) and not isinstance(n, _COMPOUND) and n.lineno <= rel <= n.end_lineno:
            if best is None or n.end_lineno - n.lineno < best.end_lineno - best.lineno:
                best = n
    return (parsed, best) if best is not None else None


def before_statement(source: dict, line: int, lines: list[str]) -> codefix.Rewrite | None:
    """The statement that holds `line` of `source`, with `lines` inserted above it (same indentation)."""
    got = statement_at(source, line)
    if got is None:
        return None
    parsed, stmt = got
    before = codefix._dedent("\n".join(parsed.text.splitlines()[stmt.lineno - 1:stmt.end_lineno]))
    return codefix.Rewrite(before=before, after="\n".join([*lines, before]), line=line, file=source.get("file"),
                           first=parsed.first + stmt.lineno - 1)


# ------------------------------------------------------------------ NaN/Inf samples in the batch: at begin()

def _assignable(n: ast.AST) -> bool:
    return isinstance(n, (ast.Name, ast.Attribute, ast.Subscript)) and \
        not any(isinstance(m, ast.Call) for m in ast.walk(n))


def _bad(t) -> bool:
    """Holds a NaN or +inf, or a -inf that is not a mask's (a tensor of -inf and finite values only is one)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return False
    return bool(torch.isnan(t).any() or torch.isposinf(t).any())


def _side(text: str, value, n_rows: list[int]) -> tuple[list[str], list[str]] | None:
    """(the keep terms for its bad tensors, the assignment that filters it) for one side of the batch, as the
    user's expression `text` names it; None where some value in it is not a tensor with the batch's rows first."""
    def rows(t) -> bool:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return False
        n_rows.append(int(t.shape[0]))
        return True

    def term(acc: str, t) -> str:
        return f"torch.isfinite({acc}).flatten(1).all(1)" if t.dim() >= 2 else f"torch.isfinite({acc})"

    if value is None:
        return [], []
    if isinstance(value, torch.Tensor):
        if not rows(value):
            return None
        return ([term(text, value)] if _bad(value) else []), [f"{text} = {text}[KEEP]"]
    if isinstance(value, (tuple, list)) and value and all(rows(v) for v in value):
        terms = [term(f"{text}[{i}]", v) for i, v in enumerate(value) if _bad(v)]
        make = "tuple(v[KEEP] for v in {})" if isinstance(value, tuple) else "[v[KEEP] for v in {}]"
        return terms, [f"{text} = {make.format(text)}"]
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value) and all(rows(v) for v in value.values()):
        terms = [term(f"{text}[{k!r}]", v) for k, v in value.items() if _bad(v)]
        return terms, [f"{text} = {{k: v[KEEP] for k, v in {text}.items()}}"]
    return None


def batch_filter(entry: dict | None, inputs, target, samples: list[int]) -> codefix.Rewrite | None:
    """The begin() line (`entry`, a snapshot's recorded frame) with the samples that hold NaN/Inf left out of
    the batch just above it, in the names the call gives the batch; None where that cannot be written for
    certain (the call's arguments are not plain names, a batch value without the rows first, no begin call)."""
    if not entry:
        return None
    source = frame_json(RecordedFrame(entry["file"], entry["line"], entry["function"], entry["code"],
                                      entry["context"]))
    got = statement_at(source, source["line"] if source else None)
    if got is None:
        return None
    parsed, stmt = got
    text = codefix.source_of_nodes(parsed)
    call = next((n for n in ast.walk(stmt) if isinstance(n, ast.Call) and codefix._callee(n) == "begin"), None)
    if call is None:
        return None
    args = {"inputs": call.args[0] if call.args else None, "target": call.args[1] if len(call.args) > 1 else None}
    for k in call.keywords:
        if k.arg in args:
            args[k.arg] = k.value
    terms, assigns, n_rows = [], [], []
    for side, value in (("inputs", inputs), ("target", target)):
        node = args[side]
        if value is None:
            continue
        if node is None or not _assignable(node):
            return None
        got_side = _side(text(node), value, n_rows)
        if got_side is None:
            return None
        terms += got_side[0]
        assigns += got_side[1]
    if not terms or len(set(n_rows)) != 1 or n_rows[0] < 2:
        return None
    taken = set(re.findall(r"[A-Za-z_]\w*", "\n".join((source.get("context") or {}).get("lines") or [])))
    keep = keep_name(taken)
    where = f"samples {samples[:20]} hold NaN/Inf" if samples else "samples that hold NaN/Inf"
    lines = [f"{keep} = {' & '.join(terms)}  # {where}: find them in the data; until then leave them out",
             *[a.replace("KEEP", keep) for a in assigns]]
    return before_statement(source, source["line"], lines)
