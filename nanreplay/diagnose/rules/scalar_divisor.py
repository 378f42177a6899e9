"""Division by a Python number that is 0: a temperature annealed to 0 (`logits / tau`, `F.gumbel_softmax(logits,
tau=tau)` with a schedule that has no floor), a scale read from a config that is 0.

The divisor is not a tensor, so division_by_zero (which reads the denominator's statistics) does not see it: the
op's only tensor input is the numerator and its scalar argument is the 0. The fix floors the number where the user
passes it: `logits / max(tau, eps)`, or the library call's argument (`tau=max(tau, eps)`). A floor below every value
the run used changes nothing in a healthy step; at 0 it gives the limit the number tends to (the argmax one-hot,
for a temperature) with finite values and gradients.
"""

from __future__ import annotations

import ast

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.fixes import choose_eps, fmt, replace_arg
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site, finite_float
from nanreplay.enums import FixKind

aten = torch.ops.aten

_DIVS = ("div", "__truediv__", "true_divide", "divide")
# a library call that divides by one of its number arguments: (its name, its position)
_LIBRARY = {"gumbel_softmax": ("tau", 1)}
_NAMES = ("tau", "temperature", "temp")  # a keyword of another library call that is a temperature


def _floored(e: float):
    return lambda t: f"max({t}, {fmt(e)})"


def _argument(name: str, call: ast.Call) -> ast.AST | None:
    """The argument of the library call that carries the divisor: its keyword, or its place."""
    base = name.rsplit(".", 1)[-1]
    key, pos = _LIBRARY.get(base, (None, None))
    for k in call.keywords:
        if k.arg == key or (key is None and k.arg in _NAMES):
            return k.value
    if pos is not None and len(call.args) > pos:
        return call.args[pos]
    return None


def _rewrite(s: Site, e: float) -> codefix.Rewrite | None:
    change = _floored(e)
    rw = s.rewrite(codefix.with_operand("other", change)) if s.call_is(*_DIVS) else None
    if rw is not None:  # the user's own `x / tau`
        return rw
    spelled = s.spelled(s.call)
    loc = codefix.locate(s.source, (s.source or {}).get("line"), spelled)
    if loc is None or not isinstance(loc.node, ast.Call):
        return None
    arg = _argument(spelled, loc.node)
    if arg is None:
        return None
    src = codefix.source_of_nodes(loc.parsed)
    return codefix.splice(s.source, loc, [(arg, change(src(arg)))], s.source["line"])


@rule("zero_scalar_divisor", aten.div, priority=71)
def _zero_scalar(s: Site) -> Diagnosis | None:
    if not (s.forward and s.op_packet == "aten.div") or len(s.inputs) != 1:
        return None
    nums = [v for v in s.event.scalars or [] if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(nums) != 1 or nums[0] != 0:
        return None
    num = s.inp(0)
    n = finite_float(num.get("absmax")) or 1.0
    fi = torch.finfo(getattr(torch, s.dtype, torch.float32))
    eps, why = choose_eps(s.dtype, n, "the quotient and its gradient", floor=n / fi.max,
                          floor_why="the quotient x / eps")
    fixes = []
    for e in (eps, eps * 100):
        rw = _rewrite(s, e)
        patch = {s.call: replace_arg(1, lambda t, e=e: max(t, e))} if s.call else None
        fixes.append(Fix(FixKind.EPSILON, "", epsilon=e, rewrite=rw, patch=patch,
                         probe={s.call: replace_arg(1, lambda t, e=e: max(t, e * 100))} if s.call else None,
                         reasoning=(why if e == eps else f"eps = {fmt(e)}: 100× the floor, in case that one does "
                                    "not verify") + ". A floor below every value the run used changes nothing in a "
                                   "healthy step; at 0 it gives the limit (for a temperature: the argmax one-hot). "
                                   "Where the schedule should stop higher (Gumbel-softmax is usually annealed to "
                                   "~0.5), put that floor in the schedule itself.",
                         guidance=f"floor the divisor at {fmt(e)} where you pass it (max(tau, {fmt(e)})) at {s.where}"))
    user = s.step.user_call(s.call) or s.call_name or "the division"
    return Diagnosis("zero_scalar_divisor", "division by a number that is 0",
                     f"{user} at {s.where} divided by the number 0 (not a tensor: a temperature, a scale or a count "
                     f"passed as a Python number), so every quotient is ±Inf or NaN. A schedule that anneals it to "
                     f"0 (tau = max(t0 - k * step, 0)) or a config value of 0 makes it. Floor it where it is "
                     f"passed, or stop the schedule above 0.", fixes)
