"""Diagnose the culprit: try the rules in priority order, then verify their fixes by replay.

The entry points of the package: `diagnose` (a culprit found, or a finite replay: see finite.py),
and `for_leaves` (NaN/Inf already in the batch or the weights), which needs no rule.
"""

from __future__ import annotations

from nanreplay import verify
from nanreplay.diagnose import (
    finite,
    magnitude,
    plausible,
    rules,  # noqa: F401  (importing the families registers every rule)
)
from nanreplay.diagnose.late import late_update
from nanreplay.diagnose.model import RULES, Diagnosis, Fix
from nanreplay.diagnose.prose import anomaly_sentence
from nanreplay.diagnose.site import Site
from nanreplay.enums import FixKind
from nanreplay.replay import Step


def diagnose(result, subject, step: Step, c: int | None, chain: list[int], *, verify_fixes: bool = True) -> dict:
    """The `diagnosis` object of the JSON contract, with fixes verified by replay."""
    info = getattr(result, "snapshot_info", None) or {}
    if c is None:
        return finite.diagnose_finite(result, subject, step if step.failure is None else None, info)
    site = Site(step, step.events[c], chain, subject, info)
    diag = RULES.answer(site)
    if verify_fixes:
        ref = plausible.Lazy(lambda: plausible.reference(info, step, subject))  # only when a replay is finite
        chosen, tried = _verify(diag, subject, ref)
    else:
        chosen, tried = diag.fixes[0], []
    explanation = diag.explanation
    out = {"cause": diag.cause, "title": diag.title}
    origin = diag.extra.get("magnitude_origin") or magnitude.origin_of(site)
    if origin is not None:
        out["magnitude_origin"] = origin
        if "magnitude_origin" not in diag.extra:  # the rule did not tell that story itself
            explanation += " " + magnitude.sentence(origin, site)
    out.update({k: v for k, v in diag.extra.items() if k != "magnitude_origin"})
    out.update({
        "explanation": explanation + " " + anomaly_sentence(result.anomaly_mode, site),
        "fix": chosen.to_json(),
        "candidates": [f.to_json() for f in tried],
    })
    return out


_ADVICE_FIRST = (FixKind.NORMALIZE_INPUT,)  # causes a replay of this step cannot test (they are in the data)


def _verify(diag: Diagnosis, subject, ref: plausible.Lazy | None) -> tuple[Fix, list[Fix]]:
    """Try each candidate fix in order; the first whose replay is finite *and* plausible wins, else the first."""
    tried = []
    for fix in diag.fixes:
        if fix.patch:
            label = ("with the rewritten line, at every call it makes" if fix.tested_as == "line" else
                     "with an op-level patch at the culprit's call (no line of yours is rewritten)")
            o = verify.try_patch(subject, fix.patch, label=label)
        elif fix.variant:
            v = fix.variant
            o = verify.try_variant(subject, dtype=v.get("dtype"), autocast=v.get("autocast", "same"),
                                   label=v.get("label", ""))
        else:
            fix.verification = fix.verification or "not replayed: not a code change at the culprit site"
            tried.append(fix)
            continue
        if o.ok:
            ok, why = plausible.judge(o.loss, o.grad_norm, o.grad_norms, ref.get() if ref is not None else None)
            fix.verified = ok is not False  # not judged (nothing to compare with) is said, not hidden
            fix.verification = f"{o.detail} — {why}"
        else:
            ok, why = False, "the replay is not finite"
            fix.verified, fix.verification = False, o.detail
        fix.replay = {"loss": o.loss, "grad_norm": o.grad_norm, "plausible": ok, "why": why}
        tried.append(fix)
        if fix.verified:
            return fix, tried
    code_fixes = [f for f in tried if f.verified is not None]
    if not code_fixes and diag.fixes and diag.fixes[0].kind not in (FixKind.NONE, FixKind.LOWER_LR_CLIP_GRADS):
        diag.fixes[0].verification = ("could not apply this fix automatically at the culprit call "
                                      "(the call is not spelled as expected); not verified")
    # none verified: advice the rule put first for a cause outside the step (the data) wins over a replayed patch
    if diag.fixes and diag.fixes[0].kind in _ADVICE_FIRST:
        return diag.fixes[0], tried
    # else show the first that at least replayed finite (marked implausible), else the first tried
    finite_ones = [f for f in code_fixes if f.replay and f.replay.get("plausible") is False and f.replay.get("loss")
                   is not None and f.replay.get("why") != "the replay is not finite"]
    return (finite_ones[0] if finite_ones else code_fixes[0] if code_fixes else diag.fixes[0]), tried


def for_leaves(verdict: str, rows: list[dict], snap) -> dict:
    """Diagnosis when NaN/Inf was already in the batch or the weights: nothing to replay."""
    names = ", ".join(f"{r['name']} ({r['nan']} NaN, {r['inf']} Inf)" for r in rows[:5])
    if verdict == "nonfinite_input":
        samples = sorted({i for r in rows for i in r.get("samples", [])})
        first = rows[0]["name"] if rows else "x"
        x = first if first.isidentifier() else "x"  # the batch tensor's own name where it is one (`images`)
        at = f" Bad samples (index along dim 0): {samples[:20]}." if samples else ""
        return {"cause": "nonfinite_input", "title": "NaN/Inf in the input batch",
                "explanation": f"The batch already holds non-finite values before the model runs: {names}.{at} "
                               "The model is not the culprit; the data pipeline is (a log of 0 or a division by 0 "
                               "in preprocessing, a corrupt record, a missing value read as NaN).",
                "fix": Fix(FixKind.CLEAN_INPUT, f"assert torch.isfinite({x}).all(), f'non-finite input in batch {{step}}'\n"
                           f"# find the source in the data pipeline; as a stopgap: {x} = torch.nan_to_num({x})",
                           verification="the batch itself is non-finite: nothing in the model to replay").to_json(),
                "candidates": []}
    late = late_update(rows, snap) if snap is not None else None
    if late is not None:  # the optimizer state it holds says which update broke what, and most likely why
        return late
    return {"cause": "nonfinite_parameters", "title": "the weights were already non-finite",
            "explanation": f"Parameters or buffers hold NaN/Inf before this step runs: {names}. An earlier step "
                           "already diverged (its update wrote NaN/Inf into the weights) and this snapshot was taken "
                           "too late. Restore the last good checkpoint, lower the learning rate and clip gradients; "
                           "capture with nanreplay.NanGuard so the first bad step is saved before the optimizer "
                           "step.",
            "fix": Fix(FixKind.RESTORE_PARAMETERS, "model.load_state_dict(torch.load('last_good.pt'))\n"
                       "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # and a lower LR",
                       verification="the weights are already non-finite: nothing in this step to replay").to_json(),
            "candidates": []}
