"""The diagnosis of a dead or cut gradient (trigger `no_gradient` / `gradient_died`): diagnose/flow.py's findings
as the contract's `diagnosis` object, with the run's history where it explains the death (an lr that jumped)."""

from __future__ import annotations

import re

from nanreplay.diagnose import flow
from nanreplay.diagnose.model import Fix
from nanreplay.diagnose.plausible import history_rows
from nanreplay.diagnose.site import finite_float
from nanreplay.enums import FixKind

FLOW_TRIGGERS = ("no_gradient", "gradient_died")
_SAID = {"detach": "a .detach()", "no_grad": "an op run under no_grad (or inference_mode)",
         "integer": "an op with an integer result",
         "reentrant_checkpoint": "a reentrant checkpoint (its region runs under no_grad, and none of its inputs needs "
                                 "a gradient)",
         "data_copy": "a copy of the parameter's value taken outside autograd (.data, .item())",
         "frozen": "requires_grad=False"}


def _at(row: dict) -> str:
    src = row.get("source")
    where = f" at {src['file']}:{src['line']} (`{src['code'].strip()}`)" if src else ""
    mod = f" in module {row['module']!r}" if row.get("module") else ""
    return f"{row.get('op') or ''}{mod}{where}"


def _line(src) -> str:
    return f"{src['file']}:{src['line']}" + (f" (`{src['code'].strip()}`)" if src.get("code") else "") \
        if isinstance(src, dict) and src.get("file") else ""


def _checkpoint_at(ck: dict) -> str:
    """Where the reentrant checkpoint was called, and what its region ran first."""
    out = f" — the checkpoint of module {ck['module']!r}" if ck.get("module") else " — the checkpoint"
    if _line(ck.get("call")):
        out += f", called at {_line(ck['call'])}"
        out += f" from {_line(ck['caller'])}" if _line(ck.get("caller")) else ""
    out += (". Its forward runs under no_grad, and since none of its inputs needs a gradient its output has no "
            "graph at all: nothing inside it learns")
    inside = _line(ck.get("inside"))
    return out + (f" (its first op, {ck.get('first_op')}, runs at {inside})" if inside else "")


_CUT_TEXT = {"detach": re.compile(r"\.detach\(\)"), "data_copy": re.compile(r"\.data(?![\w(])")}


def _cut_edit(row: dict) -> dict:
    """The cut's line with the cut taken out (`.detach()`, `.data`): an edit, where the replay verified that undoing
    the cut keeps the loss and gives the gradient back. A line that holds no such text (a cut made elsewhere and
    recorded here) gets none."""
    src, pat = row.get("source"), _CUT_TEXT.get(row.get("kind"))
    if pat is None or not isinstance(src, dict) or not src.get("file") or not isinstance(src.get("code"), str):
        return {}
    before = src["code"].strip()
    after = pat.sub("", before)
    if after == before or "\n" in before:
        return {}
    return {"code": after, "before": before, "after": after,
            "edits": [{"file": src["file"], "line": src["line"], "before": before, "after": after}]}


def _relu_edit(row: dict) -> dict:
    """The dead ReLU's line with its one relu call made a leaky_relu(x, 0.01) (`torch.relu(h)`, `F.relu(h)`,
    `h.relu()`): the change the replay verified, as an edit. An nn.ReLU() module, or a line with several relu
    calls, gets none (the advice stands)."""
    import ast

    src = row.get("source")
    if not isinstance(src, dict) or not src.get("file") or not isinstance(src.get("code"), str):
        return {}
    before = src["code"].strip()
    try:
        tree = ast.parse(before)
    except SyntaxError:
        return {}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
             and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) == "relu"]
    if len(calls) != 1 or calls[0].lineno != calls[0].end_lineno or calls[0].keywords:
        return {}
    c, f = calls[0], calls[0].func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("torch", "F") \
            and len(c.args) == 1:
        x, fn = ast.get_source_segment(before, c.args[0]), ("F" if f.value.id == "F" else "torch.nn.functional")
    elif isinstance(f, ast.Attribute) and not c.args:  # h.relu()
        x, fn = ast.get_source_segment(before, f.value), "torch.nn.functional"
    else:
        return {}
    after = before[:c.col_offset] + f"{fn}.leaky_relu({x}, 0.01)" + before[c.end_col_offset:]
    return {"code": after, "before": before, "after": after,
            "edits": [{"file": src["file"], "line": src["line"], "before": before, "after": after}]}


def lr_jump(info: dict) -> dict | None:
    """The learning rate's first jump (10x or more between two recorded steps) in the run's history."""
    rows = [(r.get("step"), finite_float(r.get("lr"))) for r in history_rows(info)]
    rows = [(s, v) for s, v in rows if v is not None and v > 0]
    for (_s0, a), (s1, b) in zip(rows, rows[1:], strict=False):
        if b > 10 * a:
            return {"from": a, "to": b, "step": s1}
    return None


def _lr_jump(jump: dict | None) -> str:
    if jump is None:
        return ""
    return (f" The run's history shows the cause: the learning rate jumped from {jump['from']:.3g} to "
            f"{jump['to']:.3g} at step {jump['step']}, and the update it made pushed the units' inputs below zero "
            "for every sample.")


def diagnose_flow(result, subject, info: dict, *, verify: bool = True) -> dict:
    gf = None
    try:
        gf = flow.analyze(subject, info, verify=verify)
    except Exception as e:  # noqa: BLE001 - report what the guard saw rather than fail the analysis
        result.warnings.append(f"the gradient-flow walk failed: {type(e).__name__}: {e}")
    dead = [d.get("name") for d in (info.get("gradient_flow") or {}).get("dead") or []]
    if gf is None or gf.get("verdict") is None:
        expl = (f"The guard saw parameters whose value reaches the loss get no gradient ({', '.join(dead[:6])}), "
                "but this replay " + ("could not walk the step (no step program)" if gf is None else
                                      "gives them a gradient") + ".")
        return {"cause": "gradient_flow_not_reproduced", "title": "dead gradients not reproduced",
                "explanation": expl, "fix": Fix(FixKind.NONE, "").to_json(), "candidates": [],
                "gradient_flow": gf or {"verdict": None, "parameters": [], "per_parameter": []}}
    rows = [r for r in gf["per_parameter"] if r["verdict"] == gf["verdict"]]
    first = rows[0]
    names = ", ".join(r["name"] for r in rows[:6]) + (f" and {len(rows) - 6} more" if len(rows) > 6 else "")
    if gf["verdict"] == "gradient_cut" and first["kind"] == "frozen":
        tied = sorted(a for a, t in getattr(subject.model, "aliases", {}).items() if first["name"] in (a, t))
        tied = [n for n in {first["name"], *tied, *(t for a, t in getattr(subject.model, "aliases", {}).items()
                                                    if a == first["name"])} if n != first["name"]]
        title = "gradient cut: a parameter tied to a trained module is frozen"
        expl = (f"{names} {'has' if len(rows) == 1 else 'have'} requires_grad=False, so no gradient ever reaches "
                f"{'it' if len(rows) == 1 else 'them'}; " + (f"it is the same tensor as {', '.join(tied)}, " if tied
                                                               else "it is shared by several modules, ")
                + "and the module holding it trains its other parameters: freezing one name froze the tied weight "
                "everywhere.")
    elif gf["verdict"] == "gradient_cut":
        title = f"gradient cut: {_SAID.get(first['kind'], first['kind'])} stops the gradient"
        ck = first.get("checkpoint") if first["kind"] == "reentrant_checkpoint" else None
        at = _checkpoint_at(ck) if isinstance(ck, dict) else (" — " + _at(first)) if first.get("op") else ""
        expl = (f"{names} take part in the loss but get no gradient: on the way from "
                f"{'them' if len(rows) > 1 else 'it'} to the loss the graph is cut by {_SAID.get(first['kind'])}"
                f"{at}.")
        if first.get("others"):
            expl += " Further cuts on the same path: " + "; ".join(_at(o) for o in first["others"]) + "."
    else:
        lz = first.get("local_zero") or {}
        frac = (f" {100 * lz['units']:.0f}% of its units ({100 * lz['elements']:.0f}% of the elements) have a zero "
                f"derivative for every sample.") if lz else ""
        via = f" (their output reaches the loss through {_at(first['via'])})" if first.get("via") else ""
        title = f"gradient zero: {first.get('op') or 'a backward node'} turns the gradient into exact zeros"
        expl = (f"{names} take part in the loss, but their gradient is exactly zero: the backward of "
                f"{_at(first)}{via} turns a non-zero gradient into zeros.{frac}")
        if first.get("kind") == "softmax_single":
            expl += " It is a softmax over a dimension of size 1: its output is 1.0 whatever its input."
        if first.get("kind") == "relu":
            gf["lr_jump"] = lr_jump(info)
            expl += _lr_jump(gf["lr_jump"])
    key = first.get("kind")
    if key == "integer" and any(a in str(first.get("op") or "") for a in (".argmax.", ".argmin.", ".max.dim", ".topk.")):
        key = "argmax"  # a choice: routing weighted by the softmax is the usual repair
    fix_kind, advice = flow.FIXES.get(key, flow.FIXES["other"])
    verified = first.get("fix", {}).get("verified") if isinstance(first.get("fix"), dict) else None
    change = {"relu": "with LeakyReLU(0.01) in place of the dead ReLU", "frozen": "with requires_grad=True on it"
              }.get(first.get("kind"), "with the cut removed")
    moved = (first.get("fix") or {}).get("replay") or {}
    same = ("the loss is unchanged bit for bit" if moved.get("loss_unchanged") else
            f"the loss moves by {100 * moved['loss_change']:.2g}%" if isinstance(moved.get("loss_change"), float)
            else "the loss changes")
    how = (f"replayed {change}: {same} and every parameter named gets a non-zero gradient" if verified
           else "not replayed" if verified is None else f"replayed {change}: "
           + str(first["fix"].get("why") or "the gradient stayed zero"))
    fix = Fix(FixKind(fix_kind), "", guidance=advice, verification=how).to_json()
    if verified and gf["verdict"] == "gradient_cut":
        fix.update(_cut_edit(first))
    elif verified and first.get("kind") == "relu":
        fix.update(_relu_edit(first))
    fix.update(verified=verified, replay=first["fix"].get("replay") if isinstance(first.get("fix"), dict) else None)
    return {"cause": gf["verdict"], "title": title, "explanation": expl, "fix": fix, "candidates": [],
            "gradient_flow": gf}
