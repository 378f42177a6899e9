"""Label smoothing over logits masked with -inf (facebookresearch/pytext#1698): F.cross_entropy(logits, y,
label_smoothing=ε) adds ε times the mean of -log_softmax over *every* class, and a masked class's log-probability
is -inf, so the loss is +inf. The chain holds only the mask's literal -inf and its propagation, so by the culprit's
definition the mask's line is blamed; the line to change is the loss's.

The exact form spreads the smoothing mass over the classes that are allowed (what label smoothing means when some
classes are impossible): (1 - ε) * the cross-entropy, minus ε times the mean log-probability over the finite ones.
Where no class is masked it is the same number as before. It is shown as an edit, not replayed (its arithmetic is
not one op-level patch of the call): the test applies it and trains.
"""

from __future__ import annotations

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site
from nanreplay.enums import FixKind
from nanreplay.replay import frame_json

aten = torch.ops.aten
ast = codefix.ast


def _smoothing_text(src, node) -> str | None:
    """F.cross_entropy(x, y, label_smoothing=e) -> the smoothing spread over x's finite classes only."""
    if not isinstance(node, ast.Call) or codefix._callee(node) != "cross_entropy" or len(node.args) != 2:
        return None
    kws = {k.arg: k.value for k in node.keywords}
    if set(kws) - {"label_smoothing", "reduction"} or "label_smoothing" not in kws:
        return None
    try:
        red = ast.literal_eval(kws["reduction"]) if "reduction" in kws else "mean"
    except ValueError:
        return None
    x, y, e = (src(a) for a in (*node.args, kws["label_smoothing"]))
    if not isinstance(node.args[0], ast.Name) or red not in ("mean", "sum", "none"):
        return None
    fn = src(node.func)[: -len("cross_entropy")]  # "F." / "torch.nn.functional." as written
    per = (f"((1 - {e}) * {fn}cross_entropy({x}, {y}, reduction=\"none\") - {e} * {fn}log_softmax({x}, 1)"
           f".nan_to_num(neginf=0.0).sum(1) / torch.isfinite({x}).sum(1))")
    return per if red == "none" else f"{per}.{red}()"


@rule("label_smoothing_masked", aten.masked_fill, aten.where, priority=47)
def _smoothing_over_masked(s: Site) -> Diagnosis | None:
    if not (s.forward and s.event.kind == "inf" and s.event.role == "literal"):
        return None
    for ev in s.chain_events():
        if ev.index <= s.event.index or ev.fwd is None:
            continue
        rec = s.step.ops[ev.fwd]
        fr = frame_json(rec.frame)
        if not (rec.call and fr and "label_smoothing" in (fr.get("code") or "")):
            continue
        rw = s.rewrite(_smoothing_text, rec.call)
        at = f"{fr['file']}:{fr['line']}"
        return Diagnosis(
            "label_smoothing_masked", "label smoothing over logits masked with -inf",
            f"the logits were masked with -inf at {s.where}, and cross_entropy's label smoothing at {at} adds ε times "
            "the mean of -log_softmax over every class: a masked class's log-probability is -inf, so the loss is "
            "+inf. A finite mask value (finfo.min) would make the loss finite but enormous, its value set by the "
            "mask constant. Spread the smoothing over the classes that are allowed instead.",
            [Fix(FixKind.FINITE_FACTOR, "", rewrite=rw,
                 guidance=None if rw else f"at {at}, spread the label smoothing over the unmasked classes only "
                                           "(the mean of -log_softmax over the finite entries), or smooth before masking",
                 reasoning="where no class is masked it is cross_entropy's own label smoothing; where some are, the "
                           "smoothing mass goes to the allowed classes only, which is what smoothing means there")])
    return None
