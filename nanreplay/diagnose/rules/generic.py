"""The honest answer when no rule recognises the pattern: what the op did, and no fix rather
than a wrong one. It claims every culprit, so it has the lowest priority."""

from __future__ import annotations

from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site
from nanreplay.enums import FixKind


def _input_summary(st: dict) -> str:
    if not st:
        return "?"
    parts = [f"{st.get('dtype')}{st.get('shape')}"]
    if st.get("min") is not None:
        parts.append(f"range {st['min']:.4g} .. {st['max']:.4g}")
    for k in ("zeros", "negatives", "nan", "inf"):
        if st.get(k):
            parts.append(f"{st[k]} {k}")
    return ", ".join(parts)


@rule("unrecognised", priority=0)
def _generic(s: Site) -> Diagnosis:
    op = s.event.op
    what = {"origin": "computed a non-finite value from finite inputs",
            "conversion": "turned Inf into NaN (inf - inf, 0 * inf, or a fully -inf softmax row)",
            "literal": "holds a non-finite constant from its arguments"}.get(s.event.role, "propagated a non-finite value")
    phase = (f"in backward ({s.event.node}, the gradient of {s.fwd_op})" if not s.forward else "in forward")
    out = s.event.out
    made = ", ".join(f"{out[k]} {k}" for k in ("nan", "posinf", "neginf") if out.get(k)) or "non-finite values"
    seen = "; ".join(f"input {i}: {_input_summary(st)}" for i, st in enumerate(s.inputs)) or "no tensor inputs"
    scal = f"; other arguments {s.event.scalars}" if s.event.scalars else ""
    return Diagnosis("unrecognised", f"{op} {what}",
                     f"{op} {what} {phase} at {s.where}: it produced {made} of {out.get('numel')} elements ({seen}"
                     f"{scal}). nanreplay has no specific rule for this pattern, so it suggests no fix rather than a "
                     "wrong one: check the op's domain against the input ranges above.",
                     [Fix(FixKind.NONE, "# no automatic suggestion for this pattern")])
