"""The diagnosis of a dead or cut gradient (trigger `no_gradient` / `gradient_died`): diagnose/flow.py's findings
as the contract's `diagnosis` object, with the run's history where it explains the death (an lr that jumped)."""

from __future__ import annotations

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


def _lr_jump(info: dict) -> str:
    """The learning rate's jump in the history before the gradients died, as a sentence ('' if none)."""
    rows = [(r.get("step"), finite_float(r.get("lr"))) for r in history_rows(info)]
    rows = [(s, v) for s, v in rows if v is not None and v > 0]
    for (_s0, a), (s1, b) in zip(rows, rows[1:], strict=False):
        if b > 10 * a:
            return (f" The run's history shows the cause: the learning rate jumped from {a:.3g} to {b:.3g} at step "
                    f"{s1}, and the update it made pushed the units' inputs below zero for every sample.")
    return ""


def diagnose_flow(result, subject, info: dict) -> dict:
    gf = None
    try:
        gf = flow.analyze(subject, info)
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
        expl = (f"{names} take part in the loss but get no gradient: on the way from "
                f"{'them' if len(rows) > 1 else 'it'} to the loss the graph is cut by {_SAID.get(first['kind'])}"
                f"{(' — ' + _at(first)) if first.get('op') else ''}.")
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
            expl += _lr_jump(info)
    fix_kind, advice = flow.FIXES.get(first.get("kind"), flow.FIXES["other"])
    verified = first.get("fix", {}).get("verified") if isinstance(first.get("fix"), dict) else None
    how = ("replayed with the cut removed: the loss is unchanged bit for bit and the gradient is non-zero"
           if verified else "not replayed" if verified is None else "replayed with the cut removed: "
           + str(first["fix"].get("why") or "the gradient stayed zero"))
    fix = Fix(FixKind(fix_kind), "", guidance=advice, verification=how).to_json()
    fix.update(verified=verified, replay=first["fix"].get("replay") if isinstance(first.get("fix"), dict) else None)
    return {"cause": gf["verdict"], "title": title, "explanation": expl, "fix": fix, "candidates": [],
            "gradient_flow": gf}
