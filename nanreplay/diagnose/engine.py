"""Diagnose the culprit: try the rules in priority order, then verify their fixes by replay.

The entry points of the package: `diagnose` (a culprit found), and the diagnoses that need no
rule: `for_leaves` (NaN/Inf already in the batch or the weights) and the finite replay.
"""

from __future__ import annotations

import math

import torch

from nanreplay import verify
from nanreplay.diagnose import rules  # noqa: F401  (importing the families registers every rule)
from nanreplay.diagnose.late import late_update
from nanreplay.diagnose.model import RULES, Diagnosis, Fix
from nanreplay.diagnose.prose import anomaly_sentence
from nanreplay.diagnose.site import Site
from nanreplay.enums import FixKind
from nanreplay.replay import Step


def diagnose(result, subject, step: Step, c: int | None, chain: list[int], *, verify_fixes: bool = True) -> dict:
    """The `diagnosis` object of the JSON contract, with fixes verified by replay."""
    if c is None:
        return _not_reproduced(result, subject)
    site = Site(step, step.events[c], chain, subject)
    diag = None
    for r in RULES:  # highest priority first
        if not r.applies_to(site):
            continue
        diag = r.fn(site)
        if diag is not None:
            if diag.cause != r.cause:
                raise RuntimeError(f"rule {r.cause!r} returned cause {diag.cause!r}")
            break
    assert diag is not None  # the generic rule always answers
    chosen, tried = _verify(diag, subject) if verify_fixes else (diag.fixes[0], [])
    out = {
        "cause": diag.cause,
        "title": diag.title,
        "explanation": diag.explanation + " " + anomaly_sentence(result.anomaly_mode, site),
        "fix": chosen.to_json(),
        "candidates": [f.to_json() for f in tried],
    }
    return out


def _verify(diag: Diagnosis, subject) -> tuple[Fix, list[Fix]]:
    """Try each candidate fix in order; the first that verifies wins, else the first."""
    tried = []
    for fix in diag.fixes:
        if fix.patch:
            o = verify.try_patch(subject, fix.patch)
        elif fix.variant:
            v = fix.variant
            o = verify.try_variant(subject, dtype=v.get("dtype"), autocast=v.get("autocast", "same"),
                                   label=v.get("label", ""))
        else:
            fix.verification = "not a code change at the culprit site: nothing to replay"
            tried.append(fix)
            continue
        fix.verified, fix.verification = o.ok, o.detail
        tried.append(fix)
        if o.ok:
            return fix, tried
    code_fixes = [f for f in tried if f.verified is not None]
    if not code_fixes and diag.fixes and diag.fixes[0].kind not in (FixKind.NONE, FixKind.LOWER_LR_CLIP_GRADS):
        diag.fixes[0].verification = ("could not apply this fix automatically at the culprit call "
                                      "(the call is not spelled as expected); not verified")
    return (code_fixes[0] if code_fixes else diag.fixes[0]), tried


def _not_reproduced(result, subject) -> dict:
    explanation = ("Replaying the snapshot's step gave a finite loss and finite gradients everywhere. "
                   "Either the failure depends on state the snapshot does not hold (RNG for dropout, "
                   "nondeterministic kernels, a different device or dtype), or it happened in a later "
                   "step (e.g. the optimizer update). nanreplay does not invent a culprit.")
    near = [a for a in getattr(result, "activations", []) if a.get("near_overflow")]
    if near:
        worst = max(near, key=lambda a: a["ratio"] if isinstance(a.get("ratio"), float) else math.inf)
        fmax = torch.finfo(getattr(torch, worst["dtype"])).max
        more = f" (and {len(near) - 1} more)" if len(near) > 1 else ""
        explanation += (f" Close to overflow, though: module {worst['module'] or '<root>'!r}{more} reached "
                        f"|x| = {worst['absmax']:.4g}, {100 * worst['ratio']:.0f}% of {worst['dtype']}'s largest "
                        f"value {fmax:.6g}; slightly larger inputs or weights will overflow. bfloat16 (float32's "
                        "range) or a normalisation before that module gives headroom.")
    return {"cause": "not_reproduced", "title": "the replay is finite", "explanation": explanation,
            "fix": Fix(FixKind.NONE, "# nothing to fix in this step").to_json(), "candidates": []}


def for_leaves(verdict: str, rows: list[dict], snap) -> dict:
    """Diagnosis when NaN/Inf was already in the batch or the weights: nothing to replay."""
    names = ", ".join(f"{r['name']} ({r['nan']} NaN, {r['inf']} Inf)" for r in rows[:5])
    if verdict == "nonfinite_input":
        samples = sorted({i for r in rows for i in r.get("samples", [])})
        at = f" Bad samples (index along dim 0): {samples[:20]}." if samples else ""
        return {"cause": "nonfinite_input", "title": "NaN/Inf in the input batch",
                "explanation": f"The batch already holds non-finite values before the model runs: {names}.{at} "
                               "The model is not the culprit; the data pipeline is (a log of 0 or a division by 0 "
                               "in preprocessing, a corrupt record, a missing value read as NaN).",
                "fix": Fix(FixKind.CLEAN_INPUT, "assert torch.isfinite(x).all(), f'non-finite input in batch {step}'\n"
                           "# find the source in the data pipeline; as a stopgap: x = torch.nan_to_num(x)",
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
