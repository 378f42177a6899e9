"""A rate passed to the optimizer by a name imported from another module of the user's, followed into that module.

`from conf import LR` then `SGD(params, lr=LR)`: the literal that set the rate is `LR = 3.0` in conf.py, and an edit
of the optimizer's line (or advice to change it there) would leave the constant, which other code may read, as it
was. This finds the module the name came from, as the running process imported it (`sys.modules`, never an
import of anything), and follows the rate there with ratesource's rules:

* `from conf import LR` + `lr=LR`, and `import conf` + `lr=conf.LR`: the module-level binding of `LR` in conf.py;
* `from conf import cfg` + `lr=cfg.lr` (or `cfg["lr"]`): conf.py's bindings of the attribute (a class body's
  `lr = 3.0`, `cfg.lr = 3.0`) or the key (`cfg = {"lr": 3.0}`).

Only absolute imports, only one import binding of the name in the optimizer's scope, only a `.py` file: anything
else is no site (never a guess). Training-side: standard library only.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable

from nanreplay.capture import ratesource, usersource


def _import_of(tree: ast.Module, scope: ast.AST, name: str) -> ast.AST | None:
    """The one import statement that binds `name` where the optimizer's line reads it, or None."""
    found = ratesource._name_bindings(scope, name)  # noqa: SLF001 - the same rules as a name in the file
    if not found and scope is not tree:
        found = ratesource._name_bindings(tree, name)  # noqa: SLF001
    if len(found) != 1 or not isinstance(found[0][0], (ast.Import, ast.ImportFrom)):
        return None
    return found[0][0]


def _module_file(name: str) -> str | None:
    """The user's .py file of an imported module (a library's, site-packages or torch, is not followed)."""
    mod = sys.modules.get(name)
    path = getattr(mod, "__file__", None) if mod is not None else None
    return path if isinstance(path, str) and path.endswith(".py") and usersource.is_user(path) else None


def follow(tree: ast.Module, scope: ast.AST, expr: ast.AST,
           parse: Callable[[str], tuple[list[str], ast.Module] | None]) -> tuple | None:
    """(path, lines, tree, (binding node, literal node, kind, name), how) of the rate's one literal in the module
    the expression's name was imported from; None where it was not imported, or is not followed there."""
    base = expr.value if isinstance(expr, (ast.Attribute, ast.Subscript)) else expr
    if not isinstance(base, ast.Name):
        return None
    imp = _import_of(tree, scope, base.id)
    if imp is None:
        return None
    alias = next(a for a in imp.names if (a.asname or a.name) == base.id)
    if isinstance(imp, ast.ImportFrom):
        if imp.level or not imp.module:
            return None  # a relative import: which package it is relative to is not read here
        if _module_file(f"{imp.module}.{alias.name}") is not None and isinstance(expr, ast.Attribute):
            module, target = f"{imp.module}.{alias.name}", ast.Name(id=expr.attr)  # from pkg import conf; conf.LR
        else:
            module, target = imp.module, (ast.Name(id=alias.name) if expr is base else expr)
            if expr is not base and alias.asname:
                return None  # `from conf import cfg as c; c.lr`: the other file's text names it cfg
    else:
        if "." in alias.name or not isinstance(expr, ast.Attribute):
            return None  # `import a.b` (a.b.LR), or the module object itself as the rate
        module, target = alias.name, ast.Name(id=expr.attr)
    path = _module_file(module)
    got = parse(path) if path else None
    if got is None:
        return None
    lines, other = got
    found = ratesource.follow(other, other, target)
    if found is None:
        return None
    shown = ast.unparse(imp) if hasattr(ast, "unparse") else module
    return path, lines, other, found, f"`{shown}`"
