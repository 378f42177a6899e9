"""Every other op with a singular or overflowing domain, from one table: op -> its edge -> its fix.

The specific rules above (log, sqrt, pow, acos/asin, division, exp in a softmax) tell richer stories
for their ops; this table answers for the rest — rsqrt at 0 (an RMSNorm without eps), log1p at -1,
atanh / erfinv at ±1, acosh at 1, logit at 0 / 1, lgamma / digamma at their poles, expm1 / cosh / sinh
overflow, fmod / remainder by 0, a norm's gradient at the zero vector — each with the operand change
that moves the input off the edge by the smallest amount the dtype tells apart (verified by replay like
every fix). tests/diagnose/test_domain_table.py hits every row's edge and checks the rule and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanreplay.diagnose.edits import codefix, posfix
from nanreplay.diagnose.fixes import edge_fix, fmt
from nanreplay.diagnose.model import Diagnosis, rule
from nanreplay.diagnose.prose import count
from nanreplay.diagnose.site import Site
from nanreplay.enums import FixKind

aten = torch.ops.aten


@dataclass(frozen=True)
class Edge:
    edge: str  # the edge of the domain, in words
    hit: Callable[[dict], bool]  # the culprit input's statistics are at that edge
    code: Callable[[str, float], str]  # the operand as the fix writes it
    change: Callable[[torch.Tensor, float], torch.Tensor]  # the same change, on the operand's value
    kind: FixKind = FixKind.CLAMP
    arg: int = 0  # the operand that is at the edge
    which: str = "input"  # its name in the call
    phases: tuple[str, ...] = ("forward", "backward")
    stat: int | None = None  # its place among the tensor inputs (default: arg; polygamma(n, x) has x first)


def _p(t: str) -> str:
    return codefix.paren(t)


def _at(v: float) -> Callable[[dict], bool]:
    """The input reaches v (its range includes v): min ≤ v ≤ max."""
    return lambda st: st.get("min") is not None and st["min"] <= v <= st["max"]


def _outside(lo: float, hi: float) -> Callable[[dict], bool]:
    return lambda st: st.get("min") is not None and (st["min"] <= lo or st["max"] >= hi)


def _zeros(st: dict) -> bool:
    return bool(st.get("zeros"))


def _nonpositive(st: dict) -> bool:
    return bool(st.get("zeros") or st.get("negatives"))


def _pole(st: dict) -> bool:  # lgamma / digamma: 0, -1, -2, ...
    return bool(st.get("zeros") or st.get("negatives"))


def _big(st: dict) -> bool:
    return st.get("absmax") is not None and st["absmax"] > 10


def _bound(dtype: str) -> float:
    return float(math.floor(math.log(torch.finfo(getattr(torch, dtype)).max)) - 1)


TABLE: dict[str, Edge] = {
    "aten.rsqrt": Edge("x ≤ 0 (rsqrt(0) = Inf, its gradient -x^-1.5/2 is Inf there)", _nonpositive,
                       lambda t, e: f"{_p(t)}.clamp_min(0) + {fmt(e)}", lambda t, e: t.clamp_min(0) + e,
                       FixKind.EPSILON),
    "aten.log1p": Edge("x ≤ -1 (log1p(-1) = -Inf)", _outside(-1.0, math.inf),
                       lambda t, e: f"{_p(t)}.clamp_min(-1 + {fmt(e)})", lambda t, e: t.clamp_min(-1 + e)),
    "aten.atanh": Edge("|x| ≥ 1 (atanh(±1) = ±Inf)", _outside(-1.0, 1.0),
                       lambda t, e: f"{_p(t)}.clamp(-1 + {fmt(e)}, 1 - {fmt(e)})", lambda t, e: t.clamp(-1 + e, 1 - e)),
    "aten.erfinv": Edge("|x| ≥ 1 (erfinv(±1) = ±Inf)", _outside(-1.0, 1.0),
                        lambda t, e: f"{_p(t)}.clamp(-1 + {fmt(e)}, 1 - {fmt(e)})",
                        lambda t, e: t.clamp(-1 + e, 1 - e)),
    "aten.acosh": Edge("x ≤ 1 (acosh(x<1) = NaN, its gradient 1/sqrt(x²-1) is Inf at 1)", _outside(1.0, math.inf),
                       lambda t, e: f"{_p(t)}.clamp_min(1 + {fmt(e)})", lambda t, e: t.clamp_min(1 + e)),
    "aten.logit": Edge("x at 0 or 1 (logit(0) = -Inf, logit(1) = Inf)", _outside(0.0, 1.0),
                       lambda t, e: f"{_p(t)}.clamp({fmt(e)}, 1 - {fmt(e)})", lambda t, e: t.clamp(e, 1 - e)),
    "aten.lgamma": Edge("x at a pole (0, -1, -2, …: lgamma = Inf)", _pole,
                        lambda t, e: f"{_p(t)}.clamp_min({fmt(e)})", lambda t, e: t.clamp_min(e)),
    "aten.digamma": Edge("x at a pole (0, -1, -2, …: digamma = ∓Inf)", _pole,
                         lambda t, e: f"{_p(t)}.clamp_min({fmt(e)})", lambda t, e: t.clamp_min(e)),
    "aten.polygamma": Edge("x at a pole (0, -1, -2, …)", _pole,
                           lambda t, e: f"{_p(t)}.clamp_min({fmt(e)})", lambda t, e: t.clamp_min(e), arg=1, stat=0),
    "aten.fmod": Edge("a divisor of 0 (fmod(x, 0) = NaN)", _zeros,
                      lambda t, e: f"{_p(t)}.clamp_min({fmt(e)})", lambda t, e: t.clamp_min(e), arg=1, which="other"),
    "aten.remainder": Edge("a divisor of 0 (remainder(x, 0) = NaN)", _zeros,
                           lambda t, e: f"{_p(t)}.clamp_min({fmt(e)})", lambda t, e: t.clamp_min(e), arg=1,
                           which="other"),
}
for _op in ("aten.expm1", "aten.cosh", "aten.sinh", "aten.exp2"):  # overflow above log(finfo.max)
    TABLE[_op] = Edge("x above the dtype's range (the result overflows)", _big,
                      lambda t, e: f"{_p(t)}.clamp(-{e:g}, {e:g})", lambda t, e: t.clamp(-e, e), phases=("forward",))

_OVERFLOW = ("aten.expm1", "aten.cosh", "aten.sinh", "aten.exp2")


@rule("domain_edge", *(getattr(aten, p.split(".", 1)[1]) for p in TABLE), priority=10)
def _domain_edge(s: Site) -> Diagnosis | None:
    row = TABLE.get(s.packet)
    if row is None or s.event.phase not in row.phases or s.event.role == "literal":
        return None
    name = s.packet.split(".", 1)[1]
    x = s.inp(row.arg if row.stat is None else row.stat) if s.forward else _forward_input(s)
    if not x or not row.hit(x):
        return None
    if s.packet in _OVERFLOW:
        # the bound where the op itself overflows, then tighter ones, each replayed: cosh(87) is finite, but what
        # consumes it may not be (sinh(x) * u / |u|, a square in the gradient norm). Where the input is shared (a
        # Lorentz exp map takes cosh and sinh of one norm), the clamp is made where it is made first: a clamp of
        # this op's input alone leaves the other overflowing.
        top = _bound(s.dtype) / (math.log(2) if s.packet == "aten.exp2" else 1)
        fixes = []
        for b in dict.fromkeys((top, float(top // 2), 20.0, 10.0, 5.0)):
            got = edge_fix(s, row.kind, None, f"{name}", lambda t, e, b=b: row.code(t, b),
                           lambda t, e, b=b: row.change(t, b), lambda e, b=b: f"clamp {name}'s input to ±{b:g}",
                           which=row.which, arg=row.arg, root=True)
            at_root = [f for f in got if f.compare_at is not None][:1]
            fixes += at_root + [f for f in got if f.compare_at is None][:1]
            for f in fixes[-2:]:
                f.epsilon, f.probe, f.probe_down = None, None, None
                f.reasoning = (f"{name} overflows {s.dtype} above x ≈ {top:g}" + (
                    f"; ±{b:g}: a tighter bound, in case what consumes {name}'s output overflows at the wider one"
                    if b != top else "") + ("; the input is shared: clamped where it is made" if f in at_root else ""))
    else:
        fixes = posfix.positive_fixes(s, row.arg, f"{name}'s input") if s.packet == "aten.rsqrt" else []
        fixes += edge_fix(s, row.kind, x.get("absmax"), f"{name} and its gradient", row.code, row.change,
                          lambda e: f"move {name}'s input off the edge by {fmt(e)}", which=row.which, arg=row.arg,
                          data_eps=x.get("absmin_nonzero") if row.kind == FixKind.EPSILON else None)
    bits = [count(x[k], k[:-1] if k.endswith("s") else k) for k in ("zeros", "negatives") if x.get(k)]
    seen = f"range {x.get('min')} .. {x.get('max')}" + (f", {', '.join(bits)}" if bits else "")
    phase = "in forward" if s.forward else f"in backward ({s.event.node})"
    act = ("Keep the input inside the domain (or find why it reaches the edge: often a value that should have "
           "been positive, or a probability rounded to exactly 0 or 1).")
    if s.library:  # not the user's line: what they can change is an argument, a config value, or the data
        act = (f"This line is inside {s.library}, not your code: do not edit it. Give the layer an eps > 0 through "
               "its argument or its config (rms_norm_eps, layer_norm_eps, eps, ...): an eps of 0 there is what "
               "lets an all-zero row reach the edge; or find why your data makes such a row. The verified patch "
               "below moves the op's input off the edge at that call, as a positive eps does.")
        for f in fixes:
            f.guidance = (f"give the {s.library} layer an eps > 0 through its argument or config value (e.g. "
                          f"rms_norm_eps=1e-6), so that {name} at {s.made_where} never sees the edge; replayed as "
                          f"an op-level patch at that call")
            f.code = "\n".join(f"# {ln}" for ln in f.guidance.splitlines())
    return Diagnosis("domain_edge", f"{name} at the edge of its domain",
                     f"{name} is singular at {row.edge}, and its input reached that edge ({seen}) at {s.where}, "
                     f"which made {'NaN' if s.event.kind == 'nan' else 'Inf'} {phase}. {act}", fixes)


def _forward_input(s: Site) -> dict:
    """A backward culprit's forward input statistics: the backward event sees the saved input as one of its
    own inputs (the one with the forward input's shape), else nothing."""
    ins = s.inputs
    return ins[1] if len(ins) > 1 else (ins[0] if ins else {})
