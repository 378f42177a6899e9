"""Where the run wrote its learning rate in the loop: `g["lr"] = ...` / `g["lr"] *= ...` (docs/sites.md).

A rate that changes between steps with no scheduler (or away from what the scheduler set) was written by the
user's code: `for g in opt.param_groups: g["lr"] *= 10`, a hand-written warmup, `opt.param_groups[0]["lr"] = x`.
Only when the guard writes a snapshot, and only when the run's rate did change so (`changed`), this finds the
statements in the user's files that assign a param group's `"lr"`: a subscript `["lr"]` of a name bound by
`for NAME in <anything>.param_groups`, or of `<anything>.param_groups[...]` itself. A dict that happens to hold
an "lr" key is not a param group. At most 4 are recorded (a fix bounds each); more, and which one wrote the rate
is a guess, so none is.
"""

from __future__ import annotations

import ast
import math
from typing import Any

MAX_WRITES = 4


def changed(optimizer: Any, scheduler: Any, history: list | None) -> dict | None:
    """{"from": the first logged rate, "to": the rate now} where the rate moved and no scheduler explains it. With
    no scheduler, a rate that moved on a logged step and came back (one step at a jumped rate: the units it killed
    stay dead) counts too: "to" is the logged rate farthest from the first."""
    try:
        g = optimizer.param_groups[0]
        now = float(g["lr"])
        rows = [r for r in (history or []) if isinstance(r, dict) and isinstance(r.get("lr"), (int, float))]
        first = float(rows[0]["lr"]) if rows else g.get("initial_lr")
        if first is None or not math.isfinite(float(first)):
            return None
        if math.isclose(now, float(first), rel_tol=1e-6):
            moved = [float(r["lr"]) for r in rows if math.isfinite(float(r["lr"]))
                     and not math.isclose(float(r["lr"]), float(first), rel_tol=1e-6)]
            if scheduler is not None or not moved:
                return None
            return {"from": float(first), "to": max(moved, key=lambda v: abs(v - float(first)))}
        if scheduler is not None:
            last = scheduler.get_last_lr()[0]
            if isinstance(last, (int, float)) and math.isclose(now, float(last), rel_tol=1e-6):
                return None  # the scheduler set it: its line is the scheduler's site
        return {"from": float(first), "to": now}
    except Exception:  # noqa: BLE001 - an optimizer without param groups: nothing to say
        return None


def _group_names(tree: ast.AST) -> set[str]:
    """Names bound by `for NAME in X.param_groups` (or `enumerate(X.param_groups)`'s second)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.For, ast.comprehension)):
            it = n.iter
            if isinstance(it, ast.Call) and getattr(it.func, "id", None) == "enumerate" and it.args:
                it = it.args[0]
                tgt = n.target.elts[1] if isinstance(n.target, ast.Tuple) and len(n.target.elts) == 2 else None
            else:
                tgt = n.target
            if isinstance(it, ast.Attribute) and it.attr == "param_groups" and isinstance(tgt, ast.Name):
                out.add(tgt.id)
    return out


def is_group_lr(target: ast.AST, groups: set[str] | None) -> bool:
    """`g["lr"]` of a param group (`groups`: the loop names; None: any name, the analysis's check of one line)."""
    if not (isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant) and target.slice.value == "lr"):
        return False
    v = target.value
    if isinstance(v, ast.Subscript) and isinstance(v.value, ast.Attribute) and v.value.attr == "param_groups":
        return True
    return isinstance(v, ast.Name) and (groups is None or v.id in groups)


def writes(tree: ast.AST) -> list[ast.stmt]:
    groups = _group_names(tree)
    out = []
    for n in ast.walk(tree):
        t = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        if len(t) == 1 and is_group_lr(t[0], groups):
            out.append(n)
    return sorted(out, key=lambda s: s.lineno)


def find(tree: ast.AST, lines: list[str], path: str, moved: dict) -> list[dict]:
    out = []
    for stmt in writes(tree):
        a, b = stmt.lineno, stmt.end_lineno or stmt.lineno
        if b - a + 1 > 20:
            continue
        text = "".join(lines[a - 1:b]).rstrip("\n")
        out.append({"what": "lr_write", "class": "param_groups", "file": path, "line": a, "text": text[:4000],
                    "values": {}, "evidence": f"it writes a param group's rate; the run's rate went from "
                                              f"{moved['from']:g} (the first logged step) to {moved['to']:g}, "
                                              "which no scheduler set"})
    return out
