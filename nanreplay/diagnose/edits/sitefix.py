"""A learning rate, an eps, a schedule or an autocast dtype fixed where the run made it: an edit of that line.

The guard records where the run's optimizer, scheduler and autocast context were made (`capture/sites.py`, the
snapshot's `sites`). A fix that sets one of them (`Fix.settings`: {"lr": 0.3}, {"eps": 1e-4},
{"schedule_cap": 1.0}, {"autocast_dtype": "bfloat16"}) becomes an edit of that line, in the same shape as every
other edit (`fix.edits`: file, line, before, after):

    torch.optim.SGD(model.parameters(), lr=3.0)        ->  torch.optim.SGD(model.parameters(), lr=0.3)
    torch.optim.Adam(model.parameters(), eps=1e-8)     ->  torch.optim.Adam(model.parameters(), eps=0.0001)
    LambdaLR(opt, f)                                   ->  LambdaLR(opt, lambda s, _f=(f): max(0.0, min(1.0, _f(s))))
    torch.autocast("cuda", dtype=torch.float16)        ->  torch.autocast("cuda", dtype=torch.bfloat16)

A site is the snapshot's data, never code: its text is only parsed (`ast.parse`, never run), and it is used only
where it still says what the capture found — a single statement holding a call of the recorded class, whose
literals are the recorded values, in a `.py` file, with nothing in it that code could hide behind (dunder names,
`eval`/`exec`/`open`/`__import__`...). Anything else is left out with one line in the analysis's warnings. The
rewrite changes the argument's text and nothing else on the line. nanreplay never opens or writes that file:
the edit is shown, the user applies it.
"""

from __future__ import annotations

import ast
import math
import os
import re

from nanreplay.capture import lrwrites, ratesource

_DENY = frozenset({"eval", "exec", "compile", "open", "__import__", "getattr", "setattr", "delattr", "globals",
                   "locals", "vars", "system", "popen", "input", "breakpoint", "exit", "quit"})
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
MAX_LINES = 20


class _Site:
    def __init__(self, d: dict, src: str, first_indent: str, tree: ast.stmt, call: ast.Call | None,
                 literal: ast.AST | None = None):
        self.d, self.src, self.indent, self.stmt, self.call = d, src, first_indent, tree, call
        self.literal = literal  # a rate set by name (`LR = 3.0` for `lr=LR`): the literal the edit changes

    @property
    def where(self) -> str:
        return f"{os.path.basename(self.d['file'])}:{self.d['line']}"


def _name(node: ast.AST) -> str | None:
    f = node.func if isinstance(node, ast.Call) else None
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _lit(v: float) -> str:
    return repr(float(v))  # 0.3, 0.0001, 1.0, 1e-05: a float, as the user's literal was


def _check(d: dict, optimizer_class: str | None) -> _Site | str:
    """The site, parsed, or why it is left out."""
    file, text, cls = d.get("file"), d.get("text"), d.get("class")
    if not isinstance(file, str) or not file.endswith(".py") or _CONTROL.search(file):
        return "its file is not a .py file"
    if not isinstance(text, str) or not text.strip() or _CONTROL.search(text.replace("\t", " ")):
        return "its text is empty or holds control characters"
    if not isinstance(cls, str) or not cls.isidentifier() or _CONTROL.search(str(d.get("evidence") or "")):
        return "its class is not a name, or its evidence holds control characters"
    lines = text.split("\n")
    if len(lines) > MAX_LINES:
        return f"its text is {len(lines)} lines long"
    indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())]
    body = "\n".join(x[len(indent):] if x.startswith(indent) else x for x in lines)
    src = body + ("\n    pass" if body.rstrip().endswith(":") else "")
    try:
        mod = ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "its text is not a Python statement"
    via = d.get("via")
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if via else (ast.AugAssign,) if d.get("what") == "lr_write" else ()
    if len(mod.body) != 1 or not isinstance(mod.body[0], (ast.Assign, ast.AnnAssign, ast.Expr, ast.Return,
                                                           ast.With, ast.AsyncWith, *kinds)):
        return "its text is not one assignment, call, return or with-statement"
    for n in ast.walk(mod):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
        if name and (name.startswith("__") or name in _DENY):
            return f"its text names {name!r}"
    what = d.get("what")
    if what == "optimizer" and cls not in (optimizer_class, "TrainingArguments"):
        return f"it makes a {cls}, not the run's {optimizer_class}"
    if what == "autocast" and cls != "autocast":
        return "it is not an autocast call"
    if via is not None:
        return _check_via(d, via, body, indent, mod.body[0])
    if what == "lr_write":
        st = mod.body[0]
        t = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AugAssign) else []
        if cls != "param_groups" or len(t) != 1 or not lrwrites.is_group_lr(t[0], None):
            return "it does not write a param group's rate"
        return _Site(d, body, indent, st, None)
    calls = [n for n in ast.walk(mod.body[0]) if isinstance(n, ast.Call) and _name(n) == cls]
    if len(calls) != 1:
        return f"its text holds {len(calls)} calls of {cls}"
    vals = d.get("values") or {}
    got = _literals(calls[0], cls)
    if any(k not in got or not math.isclose(got[k], float(v), rel_tol=1e-9) for k, v in vals.items()):
        return "its literals are not the values recorded with it"
    return _Site(d, body, indent, mod.body[0], calls[0])


def _check_via(d: dict, via, body: str, indent: str, stmt: ast.stmt) -> _Site | str:
    """A rate set by name: the statement gives that name one number literal, the rate recorded."""
    if d.get("what") != "optimizer" or not isinstance(via, dict) or via.get("kind") not in ("name", "attribute", "key") \
            or not isinstance(via.get("name"), str) or _CONTROL.search(via["name"]):
        return "its rate's source is not a name"
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and (stmt.decorator_list or len(stmt.body) != 1
                                                                     or not isinstance(stmt.body[0], ast.Pass)):
        return "its text is not a function's header"
    lit = ratesource.literal_in(stmt, via["kind"], via["name"])
    rate = (d.get("values") or {}).get("lr")
    if lit is None or not isinstance(rate, (int, float)) or \
            not math.isclose(ratesource.number(lit), float(rate), rel_tol=1e-9):
        return f"its text does not set {via['name']} to the rate recorded with it"
    return _Site(d, body, indent, stmt, None, lit)


def _literals(call: ast.Call, cls: str) -> dict[str, float]:
    alias = {"learning_rate": "lr", "adam_epsilon": "eps"}
    out = {}
    pairs = [(alias.get(k.arg, k.arg), k.value) for k in call.keywords if k.arg]
    if cls != "TrainingArguments" and len(call.args) > 1:
        pairs.append(("lr", call.args[1]))
    for k, v in pairs:
        try:
            val = ast.literal_eval(v)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            out[k] = float(val)
    return out


def sites(raw: dict, warnings: list[str]) -> list[_Site]:
    """The snapshot's sites that still say what the capture found; one warning line for each left out."""
    opt = raw.get("optimizer") if isinstance(raw.get("optimizer"), dict) else {}
    out = []
    for d in raw.get("sites") or []:
        s = _check(d, opt.get("class"))
        if isinstance(s, str):
            warnings.append(f"a recorded {d.get('what')} site was left out: {s}")
        else:
            out.append(s)
    return out


# ---------------------------------------------------------------- rewriting the argument's text, nothing else

def _offsets(src: str):
    starts, n = [], 0
    for ln in src.split("\n"):
        starts.append(n)
        n += len(ln) + 1

    def at(line: int, col: int) -> int:  # ast columns count UTF-8 bytes
        text = src.split("\n")[line - 1]
        return starts[line - 1] + len(text.encode()[:col].decode(errors="ignore"))
    return at


def _replace(src: str, changes: list[tuple[ast.AST | tuple[int, int], str]]) -> str:
    """`src` with each node's text (or an insertion at (line, col)) replaced, last first."""
    at = _offsets(src)
    spans = []
    for node, new in changes:
        if isinstance(node, tuple):
            i = at(*node)
            spans.append((i, i, new))
        else:
            spans.append((at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset), new))
    for a, b, new in sorted(spans, reverse=True):
        src = src[:a] + new + src[b:]
    return src


def _set_keywords(s: _Site, values: dict[str, float]) -> str:
    call, changes = s.call, []
    hf = s.d["class"] == "TrainingArguments"
    names = {"lr": "learning_rate", "eps": "adam_epsilon"} if hf else {}
    for key, v in values.items():
        kw = next((k for k in call.keywords if k.arg == names.get(key, key)), None)
        if kw is not None:
            changes.append((kw.value, _lit(v)))
        elif key == "lr" and not hf and len(call.args) > 1:
            changes.append((call.args[1], _lit(v)))
        else:
            before = s.src[:_offsets(s.src)(call.end_lineno, call.end_col_offset) - 1].rstrip()
            sep = " " if before.endswith((",", "(")) else ", "
            changes.append(((call.end_lineno, call.end_col_offset - 1), f"{sep}{names.get(key, key)}={_lit(v)}"))
    return _replace(s.src, changes)


def _clamp_schedule(s: _Site, cap: float) -> str | None:
    call = s.call
    arg = next((k.value for k in call.keywords if k.arg == "lr_lambda"), call.args[1] if len(call.args) > 1 else None)
    if arg is None or isinstance(arg, (ast.List, ast.Tuple)):
        return None  # one lambda per group: not rewritten
    text = ast.get_source_segment(s.src, arg)
    if not text:
        return None
    return _replace(s.src, [(arg, f"lambda s, _f=({text}): max(0.0, min({_lit(cap)}, _f(s)))")])


def _bf16(s: _Site) -> str | None:
    changes = []
    for n in ast.walk(s.call):
        if isinstance(n, ast.Attribute) and n.attr in ("float16", "half"):
            changes.append((n, ast.get_source_segment(s.src, n).rsplit(".", 1)[0] + ".bfloat16"))
        elif isinstance(n, ast.Constant) and n.value in ("float16", "half"):
            changes.append((n, '"bfloat16"'))
    return _replace(s.src, changes) if changes else None


def _bound_write(s: _Site, bound) -> str | None:
    """`g["lr"] = min(<what it wrote>, bound)`: `=` keeps its value, `*=` and the like their arithmetic."""
    if not isinstance(bound, (int, float)) or not math.isfinite(bound) or bound <= 0:
        return None
    st = s.stmt
    target = ast.get_source_segment(s.src, st.targets[0] if isinstance(st, ast.Assign) else st.target)
    value = ast.get_source_segment(s.src, st.value)
    if not target or not value:
        return None
    if isinstance(st, ast.AugAssign):
        ops = {ast.Mult: "*", ast.Div: "/", ast.Add: "+", ast.Sub: "-", ast.Pow: "**", ast.FloorDiv: "//"}
        op = ops.get(type(st.op))
        if op is None:
            return None
        value = f"{target} {op} ({value})"
    return _replace(s.src, [(st, f"{target} = min({value}, {_lit(bound)})")])


def _after(s: _Site, settings: dict) -> str | None:
    what = s.d["what"]
    if what == "lr_write":
        return _bound_write(s, settings.get("lr_bound"))
    if s.literal is not None:
        if "schedule_cap" in settings or not isinstance(settings.get("lr"), (int, float)):
            return None
        return _replace(s.src, [(s.literal, _lit(float(settings["lr"])))])
    if what == "optimizer":
        vals = {k: float(settings[k]) for k in ("lr", "eps") if isinstance(settings.get(k), (int, float))}
        if "schedule_cap" in settings:
            return None
        return _set_keywords(s, vals) if vals else None
    if what == "scheduler" and s.d["class"] == "LambdaLR" and isinstance(settings.get("schedule_cap"), (int, float)):
        return _clamp_schedule(s, float(settings["schedule_cap"]))
    if what == "autocast" and settings.get("autocast_dtype") == "bfloat16":
        return _bf16(s)
    return None


def no_bf16(raw: dict) -> str | None:
    """Why the run's device has no bfloat16 (CUDA before compute capability 8.0), or None: the CPU has it, and a
    CUDA device whose capability the snapshot does not record is not judged."""
    auto = raw.get("autocast") if isinstance(raw.get("autocast"), dict) else {}
    machine = raw.get("machine") if isinstance(raw.get("machine"), dict) else {}
    cap = machine.get("capability")
    if str(auto.get("device_type", "")) != "cuda" or not isinstance(cap, str) or not re.fullmatch(r"\d{1,3}\.\d{1,3}", cap):
        return None
    major, minor = map(int, cap.split("."))
    if (major, minor) >= (8, 0):
        return None
    name = str(machine.get("device_name") or "this GPU")[:80]
    return f"{_CONTROL.sub('', name)} (compute capability {cap}) has no bfloat16: it needs 8.0 (Ampere) or newer"


def _without_bf16(fix: dict, why: str) -> None:
    """The device cannot run the bfloat16 edit: float16 stays, with the loss scaled, or the op in float32."""
    fix["device"] = why
    alt = [a for a in fix.get("alternatives") or [] if "GradScaler" in a or "float32" in a]
    fix["code"] = "\n".join([f"# {why}. Instead:", *(f"# {a}" for a in alt or [
        "keep float16 autocast and scale the loss: scaler = torch.amp.GradScaler('cuda'), or compute the "
        "overflowing op in float32 (x.float() before it)"])])
    fix["verification"] = ((fix.get("verification") or "") + "; bfloat16 was replayed on this machine, but the "
                           "run's GPU cannot use it").lstrip("; ")
    fix["reasoning"] = ((fix.get("reasoning") or "") + f"; {why}").lstrip("; ")


def attach(diagnosis: dict, raw: dict, warnings: list[str]) -> None:
    """Turn the chosen fix's settings into edits of the lines the snapshot recorded (in place)."""
    fix = diagnosis.get("fix") if isinstance(diagnosis, dict) else None
    settings = fix.get("settings") if isinstance(fix, dict) else None
    if settings and settings.get("autocast_dtype") == "bfloat16" and (why := no_bf16(raw)):
        _without_bf16(fix, why)  # with or without a recorded autocast line
        return
    if not settings or fix.get("edits") or not raw.get("sites"):
        return
    want = "autocast" if "autocast_dtype" in settings else "scheduler" if "schedule_cap" in settings else \
        "lr_write" if "lr_bound" in settings else "optimizer"
    edits, used = [], []
    found = [s for s in sites(raw, warnings) if s.d["what"] == want]
    by_name = "lr" in settings and any(s.literal is not None for s in found)
    # a rate set by name is edited where the name is assigned; the optimizer's own line keeps the name
    rest = {k: v for k, v in settings.items() if k != "lr"} if by_name else settings
    for s in found:
        after = _after(s, settings if s.literal is not None else rest)
        if after is None or after == s.src:
            continue
        edits.append({"file": s.d["file"], "line": s.d["line"], "before": s.src, "after": after})
        used.append(s)
    if not edits:
        return
    fix["edits"] = edits
    fix["before"], fix["after"] = edits[0]["before"], edits[0]["after"]
    old = fix.get("code") or ""
    notes = old if old and all(ln.startswith("#") for ln in old.splitlines()) else ""  # guidance: kept beside it
    fix["code"] = "\n".join(f"# {os.path.basename(e['file'])}:{e['line']}\n{e['after']}" for e in edits) + \
        ("\n" + notes if notes else "")
    if want == "lr_write" and fix.get("verified") is None:
        fix["verification"] = ((fix.get("verification") or "not replayed") + f"; the bound the edit sets "
                               f"(lr <= {_lit(settings['lr_bound'])}, the rate the history trained at) is judged "
                               "over the steps that follow, which only training them shows")
    if want == "optimizer" and "lr" in settings and fix.get("verified") is None:
        fix["verification"] = ((fix.get("verification") or "not replayed") + f"; the rate the edit sets "
                               f"(lr={_lit(settings['lr'])}) is judged over the steps that follow, which only training "
                               "them shows")
    fix["sites"] = [{"what": s.d["what"], "file": s.d["file"], "line": s.d["line"],
                     "evidence": s.d.get("evidence")} for s in used]
    made = ", ".join(f"{s.where} ({s.d.get('evidence') or 'recorded'})" for s in used if s.literal is None)
    rate = ", ".join(f"{s.where}, which sets {s.d['via']['name']} ({s.d.get('evidence')})" for s in used
                     if s.literal is not None)
    if want == "lr_write":
        made = ", ".join(f"{s.where}" for s in used)
        said = f"; the line(s) that wrote the rate: {made} ({used[0].d.get('evidence') or 'recorded'})"
    else:
        said = (f"; the line that made the {want}: {made}" if made else "") + \
            (f"; the line that sets the {want}'s rate: {rate}" if rate else "")
    fix["reasoning"] = ((fix.get("reasoning") or "") + said).lstrip("; ")
