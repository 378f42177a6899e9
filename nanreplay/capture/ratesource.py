"""A rate passed to the optimizer as a name, followed to the one literal that set it (docs/sites.md).

`SGD(params, lr=LR)` passes no literal, but training scripts rarely do: the rate is a module constant, a local, a
default argument, an argparse default or a config dict entry. This follows the expression on the optimizer's
line to its assignments in the same file:

* `LR` / `lr`: the bindings of that name in the enclosing function (assignments, loop targets, parameters: a
  parameter's default counts, a parameter without one is the caller's value), else at module level;
* `args.lr` / `cfg.lr`: `add_argument("--lr", default=...)` (or `dest="lr"`), `set_defaults(lr=...)`, a class
  body's `lr = ...` / `lr: float = ...`, and `args.lr = ...`;
* `config["lr"]`: `config = {"lr": ...}`, `config = dict(lr=...)`, and `config["lr"] = ...`.

Every binding found is a candidate, a literal or not. Only where there is exactly one, and it is a number literal,
is it the rate's source: two candidates, or one that computes the rate, and the source is a guess.
`literal_in` finds the literal again in a recorded statement's text (the analysis's check, diagnose/edits/sitefix.py).
"""

from __future__ import annotations

import ast

_NOT_LITERAL = object()
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def number(node: ast.AST | None) -> float | None:
    try:
        v = ast.literal_eval(node) if node is not None else None
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def describe(expr: ast.AST) -> tuple[str, str] | None:
    """(kind, name) of a rate expression that can be followed: a name, an attribute, a constant subscript."""
    if isinstance(expr, ast.Name):
        return "name", expr.id
    if isinstance(expr, ast.Attribute):
        return "attribute", expr.attr
    if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name) and isinstance(expr.slice, ast.Constant) \
            and isinstance(expr.slice.value, str):
        return "key", expr.slice.value
    return None


def _walk_scope(node: ast.AST):
    """The nodes of one scope: nested functions and classes are not entered (their bindings are theirs)."""
    for c in ast.iter_child_nodes(node):
        yield c
        if not isinstance(c, _SCOPES):
            yield from _walk_scope(c)


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor, ast.NamedExpr, ast.comprehension)):
        return [node.target]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [node.optional_vars]
    return []


def _value(node: ast.AST, target: ast.AST):
    """The literal a binding sets, or _NOT_LITERAL (a computed value, an unpacking, a loop, `+=`)."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and target in _targets(node) and not isinstance(target, ast.Tuple):
        return node.value if number(node.value) is not None else _NOT_LITERAL
    return _NOT_LITERAL


def _names_bound(node: ast.AST, target: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target))


def _param_bindings(fn: ast.AST, name: str) -> list[tuple[ast.AST, object]]:
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = dict(zip([p.arg for p in pos[len(pos) - len(a.defaults):]], a.defaults, strict=True))
    defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None})
    params = [p.arg for p in pos + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg) if x]
    if name not in params:
        return []
    d = defaults.get(name)
    return [(fn, d if number(d) is not None else _NOT_LITERAL)]


def _name_bindings(scope: ast.AST, name: str) -> list[tuple[ast.AST, object]]:
    out: list[tuple[ast.AST, object]] = []
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        out += _param_bindings(scope, name)
    for n in _walk_scope(scope):
        if isinstance(n, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in n.names):
            out.append((n, _NOT_LITERAL))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
            out.append((n, _NOT_LITERAL))
        for t in _targets(n):
            if _names_bound(n, t, name):
                out.append((n, _value(n, t) if isinstance(t, ast.Name) else _NOT_LITERAL))
    return out


def _add_argument_dest(call: ast.Call) -> str | None:
    dest = next((k.value.value for k in call.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)), None)
    if isinstance(dest, str):
        return dest
    opts = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    longs = [o for o in opts if o.startswith("--")]
    first = longs[0][2:] if longs else opts[0].lstrip("-") if opts else None
    return first.replace("-", "_") if first else None


def _attribute_bindings(tree: ast.AST, name: str) -> list[tuple[ast.AST, object]]:
    out: list[tuple[ast.AST, object]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr == "add_argument" and _add_argument_dest(n) == name:
                d = next((k.value for k in n.keywords if k.arg == "default"), None)
                out.append((n, d if number(d) is not None else _NOT_LITERAL))
            elif n.func.attr == "set_defaults":
                out += [(n, k.value if number(k.value) is not None else _NOT_LITERAL) for k in n.keywords
                        if k.arg == name]
        if isinstance(n, ast.ClassDef):
            for s in n.body:
                for t in _targets(s):
                    if isinstance(t, ast.Name) and t.id == name:
                        out.append((s, _value(s, t)))
        for t in _targets(n):
            if isinstance(t, ast.Attribute) and t.attr == name:
                out.append((n, _value(n, t)))
    return out


def _key_bindings(tree: ast.AST, holder: str, key: str) -> list[tuple[ast.AST, object]]:
    out: list[tuple[ast.AST, object]] = []
    for n in ast.walk(tree):
        for t in _targets(n):
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == holder \
                    and isinstance(t.slice, ast.Constant) and t.slice.value == key:
                out.append((n, _value(n, t)))
            elif isinstance(t, ast.Name) and t.id == holder and isinstance(n, (ast.Assign, ast.AnnAssign)):
                v = _entry(n.value, key)
                if v is not None:
                    out.append((n, v if number(v) is not None else _NOT_LITERAL))
    return out


def _entry(value: ast.AST | None, key: str) -> ast.AST | None:
    if isinstance(value, ast.Dict):
        return next((v for k, v in zip(value.keys, value.values, strict=True)
                     if isinstance(k, ast.Constant) and k.value == key), None)
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
        return next((k.value for k in value.keywords if k.arg == key), None)
    return None


def follow(tree: ast.Module, scope: ast.AST, expr: ast.AST) -> tuple[ast.AST, ast.AST, str, str] | None:
    """(the binding node, the literal node, kind, name) of the one assignment of `expr`, or None."""
    d = describe(expr)
    if d is None:
        return None
    kind, name = d
    if kind == "name":
        found = _name_bindings(scope, name)
        if not found and scope is not tree:
            found = _name_bindings(tree, name)
        for fn in ast.walk(tree):  # `global LR` then `LR = ...` in some function: another binding of the module's
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn is not scope and any(
                    isinstance(g, ast.Global) and name in g.names for g in _walk_scope(fn)):
                found += _name_bindings(fn, name)
    elif kind == "attribute":
        found = _attribute_bindings(tree, name)
    else:
        found = _key_bindings(tree, expr.value.id, name)
    if len(found) != 1 or found[0][1] is _NOT_LITERAL:
        return None  # none, several, or one that computes the rate: its source would be a guess
    node, lit = found[0]
    return node, lit, kind, name


def literal_in(stmt: ast.stmt, kind: str, name: str) -> ast.AST | None:
    """The number literal a recorded statement gives `name` (the analysis's check of a crafted site)."""
    found = []
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        found += [lit for _, lit in _param_bindings(stmt, name)]
    for n in ast.walk(stmt):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and kind == "attribute":
            if n.func.attr == "add_argument" and _add_argument_dest(n) == name:
                found += [k.value for k in n.keywords if k.arg == "default"]
            elif n.func.attr == "set_defaults":
                found += [k.value for k in n.keywords if k.arg == name]
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n is stmt:
            for t in _targets(n):
                hit = (isinstance(t, ast.Name) and t.id == name and kind in ("name", "attribute")) or \
                    (isinstance(t, ast.Attribute) and t.attr == name and kind == "attribute") or \
                    (isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and t.slice.value == name
                     and kind == "key")
                found.append(n.value if hit else _entry(n.value, name) if kind == "key" else None)
    found = [f for f in found if f is not None and f is not _NOT_LITERAL and number(f) is not None]
    return found[0] if len(found) == 1 else None
