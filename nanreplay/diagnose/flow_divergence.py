"""A gradient that dies, vanishes or spikes while training diverges (docs/flow.md, "During a divergence").

A flow snapshot names where the gradient stops: a saturated tanh, dead ReLU units, a collapsed module. When the
run's history shows the loss (or the gradient norm) climbing before that step, or the learning rate jumping, the
saturation is not the cause. It is how the divergence shows in the gradient: the updates drove the units' inputs
out of range. The cause is the rate. The fix is the rate edit that the NaN-loss snapshot of the same run gives
(diagnose/divergence.py: `lr_clip_fix`, made an edit of the recorded line by diagnose/edits/sitefix.py).

Only the history *before* the snapshot's step is read. A spike's own step, which holds its large norm, is never
part of the evidence: a spike after healthy steps is a batch, not a divergence. A path that is cut (detach,
no_grad, argmax, a frozen weight) or a zero that no value could change (a softmax over one element, round) is
structural, and a divergence does not explain it. Those keep their diagnosis.
"""

from __future__ import annotations

from nanreplay.diagnose.divergence import Divergence, divergence, lr_clip_fix, remedy
from nanreplay.diagnose.plausible import history_rows

# the gradient_zero kinds whose zero the parameters' values make (a derivative zero in a range of inputs)
VALUE_MADE = ("relu", "saturated", "clamp", "where", "zero_multiplier", "other")


def _before(info: dict) -> dict:
    """The snapshot's info with the history cut to the steps before its own."""
    step = info.get("step")
    rows = history_rows(info)
    if isinstance(step, int):
        rows = [r for r in rows if not (isinstance(r.get("step"), int) and r["step"] >= step)]
    return {**info, "history": rows}


def diverged_before(info: dict) -> Divergence | None:
    """The divergence the history shows before the snapshot's step: a climb of the loss or the gradient norm, or a
    jump of the learning rate."""
    try:
        return divergence(_before(info))
    except (TypeError, ValueError, ArithmeticError):  # a crafted history: no divergence, the flow diagnosis stands
        return None


def _mechanism(diag: dict, gf: dict) -> str | None:
    """Whether this flow diagnosis is one a divergence explains: its mechanism's name, or None."""
    verdict = gf.get("verdict")
    if verdict == "gradient_vanished":
        return "vanished"
    if verdict != "gradient_zero":
        return None
    first = next((r for r in gf.get("per_parameter") or [] if r.get("verdict") == verdict), None)
    return first.get("kind") if isinstance(first, dict) and first.get("kind") in VALUE_MADE else None


def reframe(diag: dict, info: dict) -> dict:
    """The flow diagnosis `diag` (with its `gradient_flow`), reframed as a divergence where the history shows one
    before the step; otherwise `diag` unchanged. The flow's own diagnosis is kept as `mechanism`."""
    gf = diag.get("gradient_flow") if isinstance(diag.get("gradient_flow"), dict) else None
    kind = _mechanism(diag, gf) if gf else None
    d = diverged_before(info) if kind else None
    if d is None:
        return diag
    fix = lr_clip_fix(d, info).to_json()
    how = diag.get("title") or "the gradient stopped"
    seen = str(diag.get("explanation") or "").split(" The run's history shows the cause")[0]  # the story says it
    pushed = ("the update at the jumped rate pushed the units' inputs out of range" if d.jump else
              "each update at this rate pushed the units' inputs further out")
    until = "their derivative is exactly zero" if kind != "vanished" else "almost no gradient passes"
    expl = (f"Training diverged before this step: {d.story}. {seen} That is how the divergence shows in the "
            f"gradient, not its cause: {pushed}, until {until}. The cause is the rate: {remedy(d)}, and restart "
            f"from a checkpoint from before step {d.jump.step if d.jump else d.onset}. Changing the activation "
            "would not stop the climb.")
    mechanism = {"cause": diag.get("cause"), "title": diag.get("title"), "kind": kind, "fix": diag.get("fix")}
    gf = {**gf, "divergence": d.to_json()}
    title = f"training diverged (the mechanism: {how[:1].lower() + how[1:]})"
    return {**diag, "cause": "training_diverged", "title": title,
            "explanation": expl, "fix": fix, "divergence": d.to_json(), "mechanism": mechanism, "gradient_flow": gf}


def reframe_spike(diag: dict, info: dict) -> dict:
    """A gradient-norm spike after steps whose loss climbed: the spike is the divergence's, the fix the rate's."""
    d = diverged_before(info)
    if d is None or (d.loss is None and d.jump is None):  # a climb of the norm alone: the spike's own carriers say more
        return diag
    fix = lr_clip_fix(d, info).to_json()
    expl = (f"Training diverged before this step: {d.story}. {diag.get('explanation', '')} The spike is the "
            f"divergence's, not one batch's: {remedy(d)}, and restart from a checkpoint from before step {d.onset}.")
    mechanism = {"cause": diag.get("cause"), "title": diag.get("title"), "kind": "spike", "fix": diag.get("fix")}
    return {**diag, "cause": "training_diverged", "title": "training diverged: a gradient-norm spike on the way",
            "explanation": expl, "fix": fix, "divergence": d.to_json(), "mechanism": mechanism}
