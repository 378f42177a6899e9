"""A log-density evaluated at the edge of its support: xlogy(c, y) / xlog1py(c, y) with y at the edge (0, or -1
for xlog1py) where c is not 0. That is a true infinity, not 0 * -inf: a Beta's `(a - 1) * log(x)` at x = 0 with
a > 1 is -inf, a Dirichlet's `(alpha - 1) * log(theta)` at theta = 0 with alpha < 1 is +inf. torch.distributions
computes its log_prob this way (Beta -> Dirichlet, Gamma, Chi2, Binomial), so the culprit op runs inside torch
and the user's line is the `log_prob` call. No exact form gives a finite value (the density really is 0 or
unbounded there); the fix keeps the value inside the open support: `value.clamp(eps, 1 - eps)` on the log_prob
call (eps the dtype's resolution), which changes no value that was inside by more than one rounding step.
"""

from __future__ import annotations

import torch

from nanreplay.diagnose.edits import codefix, posfix
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site
from nanreplay.enums import FixKind

aten = torch.ops.aten
ast = codefix.ast


def _clamp_text(t: str, unit: bool) -> str:
    eps = f"torch.finfo({codefix.paren(t)}.dtype).eps"
    return f"{codefix.paren(t)}.clamp({eps}, 1 - {eps})" if unit else f"{codefix.paren(t)}.clamp_min({eps})"


def _value_arg(node) -> ast.AST | None:
    """The value a log_prob / log-density call scores: its first positional argument, or `value=`."""
    if not isinstance(node, ast.Call):
        return None
    return node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "value"), None)


def _log_prob_rewrite(s: Site, unit: bool):
    """The user's `dist.log_prob(value)` on the culprit's line, with the value clamped into the open support."""
    src = s.source
    if not src or s.library:
        return None
    for name in ("log_prob", "Tensor.xlogy", "torch.xlogy", "torch.special.xlogy"):
        base = name.rpartition(".")[2]

        def transform(text, node, base=base):
            if base == "log_prob":
                v = _value_arg(node)
            else:
                v = codefix.operand(node, "other")
            if v is None:
                return None
            whole, t = text(node), text(v)
            start = codefix._rel(node, v, whole, text)
            return whole[:start] + _clamp_text(t, unit and base == "log_prob") + whole[start + len(t):]
        rw = codefix.rewrite(src, src["line"], name if base != "log_prob" else "log_prob", transform)
        if rw is not None:
            return rw, base
    return None


@rule("log_prob_at_support_edge", aten.xlogy, aten.special_xlogy, aten.special_xlog1py, priority=175)
def _support_edge(s: Site) -> Diagnosis | None:
    """xlogy(c, y) = ±inf because y sits at the support's edge (0) where c != 0: a log-density scored at a value
    the distribution gives density 0 (or an unbounded one)."""
    if not (s.forward and s.event.kind == "inf" and s.call):
        return None
    c, y = s.inp(0), s.inp(1)
    log1p = s.packet == "aten.special_xlog1py"
    edge = -1.0 if log1p else 0.0
    if y.get("min") is None or y.get("max") is None or y["min"] > edge or y.get("negatives", 0) and not log1p:
        return None  # a negative y is outside the support (log of a negative): another cause
    pos = [] if log1p else posfix.positive_fixes(s, 1, "the distribution's rate/scale (the y of xlogy(c, y))")
    if pos:  # y is a parameter a ReLU made (Poisson's `value.xlogy(rate)`, Gamma's `xlogy(concentration, rate)`),
        # not the value scored: clamping the value (the edit below) would leave the rate at 0
        at = pos[0].edits[0]["file"] + ":" + str(pos[0].edits[0]["line"]) if pos[0].edits else "the model"
        return Diagnosis(
            "log_prob_at_support_edge", "a log-density with a rate/scale of exactly 0 (a ReLU's)",
            f"{s.packet.split('.')[1]}(c, y) at {s.where} took y = 0, and y is the distribution's rate or scale, "
            f"made non-negative by a ReLU at {at}: a Poisson with rate 0 gives its positive counts probability 0 "
            "(log-density -inf), and the ReLU passes no gradient back to bring it up again. Make the parameter "
            "positive where it is made.", pos)
    unit = (not log1p) and y["max"] <= 1.0  # a log_prob on (0, 1) or the simplex (Beta, Dirichlet): both edges
    got = None if log1p else _log_prob_rewrite(s, unit)  # xlog1py's edge is -1: an op-level patch and guidance
    rw, spelled = got if got else (None, "")
    unit = unit and spelled in ("log_prob", "")  # a raw xlogy of the user's: only y's lower edge is known

    def clamp(func, args, kwargs):
        args = list(args)
        v = args[1]
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            eps = torch.finfo(v.dtype).eps
            if log1p:
                v = v.clamp_min(-1 + eps)
            else:
                v = v.clamp(eps, 1 - eps) if unit else v.clamp_min(eps)
            args[1] = v
        return func(*args, **kwargs)
    patch = {k: clamp for k in s.same_site(s.call)}
    support = "(0, 1)" if unit else "(0, inf)"
    where_val = "the value passed to log_prob" if spelled == "log_prob" else "y"
    sign = "-inf" if (c.get("min") or 0) > 0 else "+inf" if (c.get("max") or 0) < 0 else "±inf"
    explanation = (
        f"a log-density was evaluated at the edge of its support at {s.where}: {s.packet.split('.')[1]}(c, y) with "
        f"y = {edge:g} and c = (concentration - 1) != 0 is {sign}, not 0 * -inf — the density there really is 0 "
        f"or unbounded (a Beta policy scored on an action of exactly 1, a Dirichlet on a proportion of exactly 0). "
        f"No stable form gives it a finite value; keep {where_val} inside the open support {support}.")
    guidance = (f"clamp {where_val} at {s.where} into the open support {support}: value.clamp(eps, 1 - eps) with "
                f"eps = torch.finfo(value.dtype).eps" if unit else
                f"clamp {where_val} at {s.where} away from the support's edge: "
                f"{'y.clamp_min(-1 + eps)' if log1p else 'value.clamp_min(eps)'}")
    reasoning = ("one rounding step of the dtype inside the support: every value already inside is unchanged, "
                 "the edge value gets the density one step in (finite, with a finite gradient in the "
                 "distribution's parameters). That value's log-density is then about c * log(eps) (c * -15.9 in "
                 "float32): finite, but set by eps, so a loss far from the history's can follow; where that "
                 "matters, leave out the samples at the edge (the remedy in the data)")
    return Diagnosis(
        "log_prob_at_support_edge", "a log-density evaluated at the edge of its support", explanation,
        [Fix(FixKind.CLAMP, "", rewrite=rw, patch=patch, reasoning=reasoning, guidance=guidance,
             alternatives=["leave the samples whose value is at the support's edge out of the batch"])])
