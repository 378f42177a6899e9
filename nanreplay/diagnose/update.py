"""Diagnosing an update snapshot: the rules on the culprit inside `optimizer.step()`, fixes verified by
replaying the update with them (`replay.update.try_update`: finite, and plausible — a step of sane size).

The same registry of rules as for forward and backward culprits (`diagnose/model.py`); the optimizer
family (`rules/optimizer.py`) answers first for every culprit in phase "optimizer".
"""

from __future__ import annotations

from nanreplay.diagnose import rules  # noqa: F401  (importing the families registers every rule)
from nanreplay.diagnose.model import RULES, Diagnosis, Fix
from nanreplay.diagnose.update_site import UpdateSite
from nanreplay.enums import FixKind
from nanreplay.replay.update import UpdateReplay, UpdateSubject, try_update


def diagnose_update(us: UpdateSubject, upd: UpdateReplay, c: int | None, chain: list[int], *,
                    verify_fixes: bool = True) -> dict:
    """The `diagnosis` object of the JSON contract for a replayed update."""
    if c is None:
        return _finite(us, upd)
    site = UpdateSite(upd.step, upd.step.events[c], chain, us, us=us, upd=upd)
    diag = RULES.answer(site)  # the optimizer family claims every update culprit
    chosen, tried, replays = _verify(diag, us) if verify_fixes else (diag.fixes[0], [], {})
    fix = chosen.to_json()
    if id(chosen) in replays:
        fix["replay"] = replays[id(chosen)]
    return {"cause": diag.cause, "title": diag.title, "explanation": diag.explanation, "fix": fix,
            "candidates": [{**f.to_json(), **({"replay": replays[id(f)]} if id(f) in replays else {})}
                           for f in tried]}


def _verify(diag: Diagnosis, us: UpdateSubject) -> tuple[Fix, list[Fix], dict[int, dict]]:
    """Replay the update with each candidate in order; the first finite and plausible one wins."""
    tried, replays = [], {}
    for fix in diag.fixes:
        change = (fix.variant or {}).get("update")
        if change is None:
            fix.verification = "not a change the update replay can apply: nothing to replay"
            tried.append(fix)
            continue
        t = try_update(us, fix.variant.get("label", "with the fix"), **change)
        fix.verified, fix.verification = t.ok, t.detail
        replays[id(fix)] = t.replay
        tried.append(fix)
        if t.ok:
            return fix, tried, replays
    verified = [f for f in tried if f.verified is not None]
    return (verified[0] if verified else diag.fixes[0]), tried, replays


def _finite(us: UpdateSubject, upd: UpdateReplay) -> dict:
    how = {"copied": "from an exact copy of the weights and state before the step",
           "reconstructed": "from weights and state recovered from what the step left behind",
           "post_step": ""}[us.pre_step]
    broke = ", ".join(f"{n} ({c['nan'] + c['posinf'] + c['neginf']} entries)" for n, c in us.nonfinite_after.items())
    expl = (f"Replaying the recorded {us.cls} update {how} gives finite weights everywhere, but in training it "
            f"wrote NaN/Inf into {broke or 'the weights'}. ")
    if us.pre_step == "reconstructed":
        expl += ("The recovery is exact only to a rounding step, and entries the update overwrote hold stand-ins; "
                 "capture with NanGuard(..., keep_pre_step=True) for an exact copy of the weights before each step.")
    else:
        expl += ("The difference lies outside what the snapshot holds: another device's kernels (a CUDA or fused "
                 "path replayed on the CPU), or nondeterminism.")
    return {"cause": "not_reproduced", "title": "the replayed update is finite", "explanation": expl,
            "fix": Fix(FixKind.NONE, "# nothing to fix in this replay").to_json(), "candidates": []}
