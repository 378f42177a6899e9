"""Where the run's optimizer, LR scheduler and autocast context were made: the snapshot's `sites` field.

A learning rate, an Adam eps, a schedule or an autocast dtype is fixed on the line that wrote it, and that line
is not in the step: the optimizer was made before the loop. So when the guard writes a snapshot (never on a
healthy step), it reads the user's files on the call stack (the training loop's, and the file of the model's
class: a LightningModule's `configure_optimizers`) and looks for the calls that made them, by name:

* the optimizer: a call of its class (`torch.optim.SGD(...)`), or `TrainingArguments(learning_rate=...)`;
* the scheduler: a call of its class (`LambdaLR(...)`);
* autocast: an `autocast(...)` call that names the dtype the step ran in (`dtype=torch.float16`).

A call is recorded only with evidence, and only when it is the one: an optimizer's call must pass
a literal (`lr=3.0`, `eps=1e-8`) and every literal it passes must equal the run's value (the param group's
`initial_lr` or `lr`, its `eps`); where several calls qualify equally none is recorded — never a guess.
Each site is plain data: file, line, the statement's text, what it made, the class, the literal values and the
evidence in words (docs/sites.md). The analysis checks it
again before it rewrites the text (`diagnose/edits/sitefix.py`).
"""

from __future__ import annotations

import ast
import math
import os
import sys
from typing import Any

from nanreplay.capture import lrwrites, rateimport, ratesource, usersource

MAX_FILES = 8
MAX_BYTES = 1_000_000  # all files together: parsing costs ~4 µs a byte, paid only when a snapshot is written
MAX_LINES = 20  # the longest statement recorded
_KEYS = {"optimizer": ("lr", "eps", "learning_rate", "adam_epsilon", "momentum", "weight_decay")}
_HALF_NAMES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16"}


def user_files(model: Any, depth: int = 2) -> list[str]:
    """The user's .py files: those of the frames on the stack (innermost first), then the model class's file."""
    return usersource.model_class_files(model, usersource.stack_files(depth, MAX_FILES), MAX_FILES)


def call_name(node: ast.AST) -> str | None:
    f = node.func if isinstance(node, ast.Call) else None
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def literals(call: ast.Call, keys: tuple[str, ...], lr_position: int | None = None) -> dict[str, float]:
    """The keyword arguments in `keys` given as number literals (and the rate given positionally)."""
    out: dict[str, float] = {}
    pairs = [(k.arg, k.value) for k in call.keywords if k.arg in keys]
    if lr_position is not None and len(call.args) > lr_position:
        pairs.append(("lr", call.args[lr_position]))
    for k, v in pairs:
        try:
            val = ast.literal_eval(v)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            out[k] = float(val)
    return out


def dtypes_named(call: ast.Call) -> set[str]:
    """The low-precision dtypes an autocast call names (`torch.float16`, `"float16"`, `torch.half`; both arms of
    `torch.bfloat16 if bf16 else torch.float16`)."""
    out = set()
    for n in ast.walk(call):
        if isinstance(n, ast.Attribute) and n.attr in _HALF_NAMES:
            out.add(_HALF_NAMES[n.attr])
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in _HALF_NAMES:
            out.add(_HALF_NAMES[n.value])
    return out


def _same(a: float, b: Any) -> bool:
    return isinstance(b, (int, float)) and math.isfinite(float(b)) and math.isclose(a, float(b), rel_tol=1e-6)


def statement_lines(stmt: ast.stmt) -> tuple[int, int]:
    """A simple statement's lines; a compound one's header only (`with torch.autocast(...):`)."""
    body = getattr(stmt, "body", None)
    if isinstance(body, list) and body and not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                 ast.ClassDef)):
        return stmt.lineno, max(stmt.lineno, body[0].lineno - 1)
    return stmt.lineno, stmt.end_lineno or stmt.lineno


def _calls(tree: ast.AST):
    """(call, the innermost statement holding it, the innermost function holding it or the module)."""
    stack: list[tuple[ast.AST, ast.stmt | None, ast.AST]] = [(tree, None, tree)]
    while stack:
        node, stmt, scope = stack.pop()
        if isinstance(node, ast.stmt):
            stmt = node
        if isinstance(node, ast.Call) and stmt is not None:
            yield node, stmt, scope
        inner = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else scope
        stack.extend((c, stmt, inner) for c in ast.iter_child_nodes(node))


def _wanted(optimizer: Any, scheduler: Any, autocast: dict | None, history: list | None) -> dict[str, Any]:
    want: dict[str, Any] = {}
    if optimizer is not None and getattr(optimizer, "param_groups", None):
        g = optimizer.param_groups[0]
        logged = [r.get(k) for r in (history or [])[:1] if isinstance(r, dict) for k in ("base_lr", "lr")]
        lrs = [v for v in (g.get("initial_lr"), g.get("lr"), *logged) if isinstance(v, (int, float))]
        want["optimizer"] = {"class": type(optimizer).__name__, "lr": lrs, "eps": g.get("eps"),
                             "momentum": g.get("momentum"), "weight_decay": g.get("weight_decay")}
    if scheduler is not None:
        want["scheduler"] = {"class": type(scheduler).__name__}
    moved = lrwrites.changed(optimizer, scheduler, history) if optimizer is not None else None
    if moved:
        want["lr_write"] = moved
    dt = str((autocast or {}).get("dtype", "")).removeprefix("torch.")
    if autocast and dt in ("float16", "bfloat16"):
        want["autocast"] = {"class": "autocast", "dtype": dt}
    return want


def _judge(what: str, want: dict, call: ast.Call) -> tuple[int, dict, str] | None:
    """(how many literals agree, the literals, the evidence in words), or None where the call is not it."""
    name = call_name(call)
    if what == "optimizer":
        hf = name == "TrainingArguments"
        if name != want["class"] and not hf:
            return None
        vals = literals(call, _KEYS["optimizer"], None if hf else 1)
        if hf:
            vals = {{"learning_rate": "lr", "adam_epsilon": "eps"}.get(k, k): v for k, v in vals.items()
                    if k in ("learning_rate", "adam_epsilon", "weight_decay")}
            if "lr" not in vals:
                return None  # TrainingArguments without a rate: nothing of the optimizer's on it
        agree = []
        for k, v in vals.items():
            ok = any(_same(v, x) for x in want["lr"]) if k == "lr" else _same(v, want.get(k))
            if not ok:
                return None  # a literal the run's optimizer does not have: another optimizer's line
            agree.append(f"{({'lr': 'learning_rate', 'eps': 'adam_epsilon'} if hf else {}).get(k, k)}={v:g}")
        if not agree:
            return None  # `lr=lr`: nothing on the line says it made this optimizer, and the line may make others
        return len(agree), vals, f"`{name}(` with {', '.join(agree)}, as the run's {want['class']} has"
    if what == "scheduler":
        if name != want["class"]:
            return None
        return 0, {}, f"the `{name}(` call: the run's scheduler is a {name}"
    if name != "autocast" or want["dtype"] not in dtypes_named(call):
        return None
    return 1, {}, f"`autocast(` naming {want['dtype']}; the step ran under {want['dtype']} autocast"


def _rate_site(want: dict, call: ast.Call, tree: ast.Module, scope: ast.AST, lines: list[str],
               path: str, parse=None) -> dict | None:
    """The one literal a rate passed as a name was set by (`lr=LR` -> `LR = 3.0`), as a site, or None; in the
    module the name was imported from where it was (`from conf import LR`: conf.py's `LR = 3.0`, rateimport.py)."""
    name = call_name(call)
    hf = name == "TrainingArguments"
    if name != want["class"] and not hf:
        return None
    key = "learning_rate" if hf else "lr"
    expr = next((k.value for k in call.keywords if k.arg == key), None)
    if expr is None and not hf and len(call.args) > 1:
        expr = call.args[1]
    if expr is None or ratesource.number(expr) is not None:
        return None
    others = literals(call, ("eps", "momentum", "weight_decay", "adam_epsilon"))
    if any(not _same(v, want.get({"adam_epsilon": "eps"}.get(k, k))) for k, v in others.items()):
        return None  # a literal the run's optimizer does not have: another optimizer's line
    got = ratesource.follow(tree, scope, expr)
    call_path, imported = path, ""
    if got is None and parse is not None:
        there = rateimport.follow(tree, scope, expr, parse)
        if there is None:
            return None
        path, lines, tree, got, how_imported = there
        imported = f"imported by {how_imported}: "
    if got is None:
        return None
    node, lit, kind, label = got
    given = [o for a in (node.args if isinstance(node, ast.Call) else []) if isinstance(a, ast.Constant)
             and isinstance(o := a.value, str) and o.startswith("-")]
    if any(x == o or x.startswith(o + "=") for x in sys.argv[1:] for o in given):
        return None  # the option was given on the command line: the default is not what set the rate
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            call_name(c) == node.name and any(k.arg in (label, None) for k in c.keywords) for c in ast.walk(tree)
            if isinstance(c, ast.Call)):
        return None  # a call passes the rate: the default may not be what set it
    value = ratesource.number(lit)
    if value is None or not any(_same(value, x) for x in want["lr"]):
        return None  # the literal is not the run's rate: the rate came from somewhere else
    stmt = node if isinstance(node, ast.stmt) else None
    if stmt is None:  # an add_argument / set_defaults call: the statement holding it
        stmt = next((s for c, s, _ in _calls(tree) if c is node), None)
    if stmt is None:
        return None
    header = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))  # a default argument: the def's header
    a, b = (stmt.lineno, max(stmt.lineno, stmt.body[0].lineno - 1)) if header else statement_lines(stmt)
    if b - a + 1 > MAX_LINES or (header and stmt.body[0].lineno == a):
        return None
    how = f"the default of {label} in `def {stmt.name}(`" if header else \
        f"the default of `{call_name(node)}(`" if isinstance(node, ast.Call) else "its one assignment"
    written = ast.unparse(expr) if imported else ast.get_source_segment("".join(lines), expr) or label
    held = "".join(lines[a - 1:b]).rstrip("\n")
    return {"what": "optimizer", "class": name, "file": path, "line": a, "call_line": call.lineno,
            "text": held[:4000], "values": {"lr": value}, "via": {"kind": kind, "name": label},
            "evidence": f"`{key}={written[:80]}` on the {name}( line ({os.path.basename(call_path)}:{call.lineno}); "
                        f"{imported}{how} sets {value:g}"
                        f"{f' in {os.path.basename(path)}' if imported else ''}, as the run's {want['class']} has, "
                        "and nothing else sets it"}


def find(files: list[str], optimizer: Any, scheduler: Any, autocast: dict | None,
         history: list | None = None, sources: usersource.Sources | None = None) -> list[dict]:
    """The construction sites in `files`, each with its evidence; none for a kind that is missing or ambiguous.
    The rate on the line may be the one the first logged step trained at (`history`): the rate was changed since."""
    want = _wanted(optimizer, scheduler, autocast, history)
    if not want:
        return []
    found: dict[str, list[tuple[int, dict]]] = {k: [] for k in (*want, "rate")}
    sources = sources or usersource.Sources()
    budget = MAX_BYTES
    for path in files:
        got = sources.parse(path)
        size = sum(map(len, got[0])) if got else 0
        if got is None or size > budget:
            continue
        budget -= size
        lines, tree = got
        if "lr_write" in want:
            found["lr_write"] += [(1, r) for r in lrwrites.find(tree, lines, path, want["lr_write"])]
        for call, stmt, scope in _calls(tree):
            if "optimizer" in want:
                rec = _rate_site(want["optimizer"], call, tree, scope, lines, path, sources.parse)
                if rec and all((r["file"], r["line"]) != (rec["file"], rec["line"]) for _, r in found["rate"]):
                    found["rate"].append((1, rec))
            for what, w in want.items():
                j = _judge(what, w, call) if what != "lr_write" else None
                if j is None:
                    continue
                a, b = statement_lines(stmt)
                if b - a + 1 > MAX_LINES:
                    continue
                score, vals, ev = j
                rec = {"what": what, "class": call_name(call), "file": path, "line": a, "call_line": call.lineno,
                       "text": "".join(lines[a - 1:b]).rstrip("\n")[:4000], "values": vals, "evidence": ev}
                if all((r["file"], r["line"]) != (path, a) for _, r in found[what]):
                    found[what].append((score, rec))
    out = []
    if found["rate"] and any("lr" in r["values"] for _, r in found.get("optimizer", [])):
        found["rate"], found["optimizer"] = [], []  # a literal rate and a named one, each the run's: a guess
    for what, recs in found.items():
        if not recs:
            continue
        best = max(s for s, _ in recs)
        top = [r for s, r in recs if s == best]
        if what == "autocast":
            out += top[:4]  # every autocast that names the dtype: a fix changes each of them
        elif what == "lr_write" and len(top) <= lrwrites.MAX_WRITES:
            out += top  # every statement that writes a group's rate: the fix bounds each
        elif len(top) == 1:
            out.append(top[0])  # two equal candidates: which one made it is a guess, so neither is recorded
    return out


def record(model: Any, optimizer: Any, scheduler: Any, autocast: dict | None,
           history: list | None = None, sources: usersource.Sources | None = None) -> list[dict] | None:
    """The `sites` field, or None where it cannot be read (never raises into the loop)."""
    try:
        return find(user_files(model, depth=1), optimizer, scheduler, autocast, history, sources)
    except Exception:  # noqa: BLE001 - a snapshot without sites is still a snapshot
        return None
