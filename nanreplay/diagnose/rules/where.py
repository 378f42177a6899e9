"""The torch.where trap: an op outside its domain on the branch where() discards. Forward is
fine, backward multiplies 0 by an Inf derivative. It outranks the domain-edge rules for the
same ops (log_of_zero, sqrt_at_zero, division_by_zero, ...), which would claim it too: their
epsilon changes the values where() keeps, the double where leaves them exactly as they were.
"""

from __future__ import annotations

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.fixes import denominator_index, operand_fn, replace_arg
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site
from nanreplay.enums import FixKind

aten = torch.ops.aten


_DOMAIN = {  # op -> (which input is unsafe, safe-mask builder, a safe value, readable condition)
    "aten.log": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.log2": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.log10": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.sqrt": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.rsqrt": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.pow": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.reciprocal": (0, lambda x: x != 0, 1.0, "x != 0"),
    "aten.acos": (0, lambda x: x.abs() < 1, 0.0, "x.abs() < 1"),
    "aten.asin": (0, lambda x: x.abs() < 1, 0.0, "x.abs() < 1"),
    "aten.div": (1, lambda x: x != 0, 1.0, "y != 0"),
}


@rule("where_trap", *(getattr(aten, p.split(".")[1]) for p in _DOMAIN), priority=190)
def _where_trap(s: Site) -> Diagnosis | None:
    if s.packet not in _DOMAIN or s.event.fwd is None:
        return None
    if "aten.where" not in s.consumer_packets():
        return None
    failure = s.step.failure
    if failure is None or failure.what != "gradient":
        return None
    idx, ok, safe, cond = _DOMAIN[s.packet]
    if s.packet == "aten.div":
        idx = denominator_index(s.call_name)
    fn_name = s.call_name.rsplit(".", 1)[-1] or s.packet.split(".")[1]
    var = "y" if s.packet == "aten.div" else "x"
    rw = s.rewrite(codefix.with_operand("other" if s.packet == "aten.div" else "input",
                                        lambda t: f"torch.where({cond.replace(var, codefix.paren(t))}, {t}, {safe})"))
    fn = operand_fn(rw) or (lambda t: torch.where(ok(t), t, torch.full_like(t, safe)))
    patch = s.at_calls(replace_arg(idx, fn), rewrite=rw)
    what = "the denominator" if s.packet == "aten.div" else f"{fn_name}'s input"
    return Diagnosis(
        "where_trap", f"the torch.where trap: {fn_name} outside its domain on the branch where() discards",
        f"torch.where(cond, {fn_name}(x), other) computed {fn_name} on every element, including those where cond "
        f"is False. Forward discards them, but backward multiplies their gradient (0) by {fn_name}'s derivative "
        f"there (Inf or NaN), and 0 * Inf = NaN reaches the gradients ({s.where}). The fix is the double where: "
        f"make the input safe *before* the op, so the discarded branch is finite too.",
        [Fix(FixKind.DOUBLE_WHERE, "", rewrite=rw, patch=patch,
             guidance=f"at {s.where}, replace {what} by {safe} where {cond.replace(var, 'it')} does not hold, before "
                      f"{fn_name} runs (torch.where inside as well as outside)",
             reasoning="the inner where feeds the op only values where it is defined; the outer where "
                       "keeps the result exactly as before")])
