"""The diagnosis of a `gradient_vanished` snapshot (capture/vanish.py): the modules whose share of the gradient norm
collapsed, checked against the replay's own gradients, and the run's history where it explains the collapse (an lr
that jumped before it)."""

from __future__ import annotations

import math

from nanreplay.diagnose.model import Fix
from nanreplay.diagnose.plausible import history_rows, norm_squared
from nanreplay.diagnose.site import finite_float
from nanreplay.enums import FixKind

GUIDE = ("a stretch of saturated (sigmoid/tanh) or dead units passes almost no gradient back: lower the learning rate "
         "(and clip the gradient norm) so one update cannot push the units into saturation; use non-saturating "
         "activations, normalisation before them, or residual connections around the deep stretch")

START_GUIDE = ("the gradient shrinks at every saturating activation on its way back (a sigmoid's derivative is at "
               "most 0.25; a tanh at a small init multiplies by the small weights): replace the sigmoid/tanh between "
               "the hidden layers with GELU or ReLU and initialise those layers to match "
               "(torch.nn.init.kaiming_normal_(layer.weight, nonlinearity='relu'), bias 0), or add residual "
               "connections around the deep stretch. Normalisation alone in front of the sigmoids is not enough "
               "(their 0.25 per layer remains); with plain SGD a narrow ReLU/GELU stack may need Adam or a smaller "
               "rate so its units do not die")


def _sq(g: dict) -> float | None:
    if math.prod(g.get("shape") or [1]) == 1:  # a one-element gradient has no std: its square is its mean's
        m = finite_float(g.get("mean"))
        return m * m if m is not None else None
    return norm_squared(g)


def _lr_jump(info: dict) -> tuple[int, float, float] | None:
    rows = [(r.get("step"), finite_float(r.get("lr"))) for r in history_rows(info)]
    rows = [(s, v) for s, v in rows if v is not None and v > 0]
    for (_s0, a), (s1, b) in zip(rows, rows[1:], strict=False):
        if b > 10 * a:
            return s1, a, b
    return None


def diagnose_vanished(result, step, info: dict) -> dict:
    gf = info.get("gradient_flow") if isinstance(info.get("gradient_flow"), dict) else {}
    seen = [v for v in gf.get("vanished") or [] if isinstance(v, dict) and isinstance(v.get("module"), str)]
    sq = {g["name"]: v for g in (step.grads if step is not None else []) if g.get("has_grad")
          and (v := _sq(g)) is not None}
    total = math.sqrt(sum(sq.values())) if sq else None
    rows = []
    for v in seen:
        mod = v["module"]
        own = [n for n in sq if (n.rpartition(".")[0] if "." in n else "") == mod]
        norm = math.sqrt(sum(sq[n] for n in own)) if own else None
        share = norm / total if norm is not None and total else None
        med, floor = finite_float(v.get("median_share")), finite_float(v.get("floor"))
        row = {"module": mod, "parameters": own, "recorded_share": finite_float(v.get("share")),
               "median_share": med, "replayed_share": share,
               "reproduced": share is not None and (share < med / 1e4 if med is not None else
                                                    floor is not None and share < floor)}
        if floor is not None:  # below an absolute floor from the first step (capture/vanish.py)
            row["floor"] = floor
        rows.append(row)
    names = ", ".join(repr(r["module"] or "<root>") for r in rows[:6]) + \
        (f" and {len(rows) - 6} more" if len(rows) > 6 else "")
    if rows and all("floor" in r for r in rows):
        return _from_the_start(rows, names)
    worst = min((r for r in rows if r["recorded_share"] and r["median_share"]),
                key=lambda r: r["recorded_share"] / r["median_share"], default=None)
    expl = (f"The gradient of module(s) {names} has collapsed: "
            + (f"{worst['module'] or '<root>'!r} carries {worst['recorded_share']:.3g} of the gradient norm against "
               f"a median share of {worst['median_share']:.3g} over the steps before"
               if worst else "their share of the gradient norm fell far below its median") + ", and the guard saw "
            "it on several samples in a row. The gradient is not exactly zero; it is too small to train them.")
    reproduced = bool(rows) and all(r["reproduced"] for r in rows)
    expl += (" The replay gives the same collapse." if reproduced else
             " The replay's gradients do not show the collapse for every module." if rows else "")
    jump = _lr_jump(info)
    if jump:
        expl += (f" The run's history shows the cause: the learning rate jumped from {jump[1]:.3g} to {jump[2]:.3g} "
                 f"at step {jump[0]}, and the update it made saturated the units in front of these modules.")
    fix = Fix(FixKind.LOWER_LR_CLIP_GRADS, "", guidance=GUIDE, verification="not replayed: the collapse is in the "
              "weights the run's updates made, not in one op of this step").to_json()
    params = [n for r in rows for n in r["parameters"]]
    return {"cause": "gradient_vanished", "title": "gradient vanished: module(s) whose share of the gradient norm "
            "collapsed", "explanation": expl, "fix": fix, "candidates": [],
            "gradient_flow": {"verdict": "gradient_vanished", "parameters": params, "per_parameter": [],
                              "vanished": rows, "reproduced": reproduced}}


def _from_the_start(rows: list[dict], names: str) -> dict:
    """Vanishing from the first step: the input end's share stayed below the floor (capture/vanish.py)."""
    low = min(rows, key=lambda r: r["recorded_share"] or math.inf)
    floor = rows[0]["floor"]
    expl = (f"The gradient vanishes on its way back to the input end of the model, from the first step: module(s) "
            f"{names} each carry less than {floor:.3g} of the gradient norm on every one of the first steps "
            f"(the lowest, {low['module'] or '<root>'!r}, {low['recorded_share']:.3g}). No update this run made did "
            "it: the architecture and its init pass almost no gradient back through the layers, so these modules "
            "do not learn while the layers near the output do. The gradient is not exactly zero; it is too small "
            "to train them.")
    reproduced = all(r["reproduced"] for r in rows)
    expl += (" The replay gives the same shares." if reproduced else
             " The replay's gradients do not show it for every module.")
    fix = Fix(FixKind.NON_SATURATING, "", guidance=START_GUIDE,
              verification="not replayed: judged over the steps that follow (the first layers' shares rise by "
              "orders of magnitude and the loss falls; docs/flow.md)").to_json()
    params = [n for r in rows for n in r["parameters"]]
    return {"cause": "gradient_vanished", "title": "gradient vanished from the first step: the input end of the "
            "model carries almost none of the gradient norm", "explanation": expl, "fix": fix, "candidates": [],
            "gradient_flow": {"verdict": "gradient_vanished", "parameters": params, "per_parameter": [],
                              "vanished": rows, "reproduced": reproduced, "from_start": True}}
