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

from nanreplay.diagnose import codefix

ast = codefix.ast
_NOT_ROWS = codefix._MODULE_NAMES | {"self", "math", "np", "numpy", "True", "False", "None"}


def read_names(stmt: ast.stmt) -> list[str]:
    """The names a statement reads as values, in order of first use: not the modules it calls through
    (`torch.log`), not functions it calls, not the names it assigns."""
    called = {id(n.func) for n in ast.walk(stmt) if isinstance(n, ast.Call)}
    bases = set()
    for n in ast.walk(stmt):  # torch.nn.functional.mse_loss: every name under a called attribute chain
        if isinstance(n, ast.Attribute) and id(n) in called:
            v = n.value
            while isinstance(v, ast.Attribute):
                v = v.value
            bases.add(id(v))
    out: list[str] = []
    for n in sorted((n for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)),
                    key=lambda n: (n.lineno, n.col_offset)):
        if id(n) in called or id(n) in bases or n.id in _NOT_ROWS or n.id in out:
            continue
        out.append(n.id)
    return out


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
