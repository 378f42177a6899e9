"""Diagnose the culprit: try the rules in priority order, then verify their fixes by replay.

The entry points of the package: `diagnose` (a culprit found, or a finite replay: see finite.py),
and `for_leaves` (NaN/Inf already in the batch or the weights), which needs no rule.
"""

from __future__ import annotations

import math

import torch

from nanreplay import noop, verify
from nanreplay import torch_internals as ti
from nanreplay.diagnose import (
    finite,
    magnitude,
    plausible,
    rules,  # noqa: F401  (importing the families registers every rule)
)
from nanreplay.diagnose.edits import datafix
from nanreplay.diagnose.late import late_update
from nanreplay.diagnose.model import EXACT_KINDS, RULES, Diagnosis, Fix
from nanreplay.diagnose.prose import anomaly_sentence
from nanreplay.diagnose.site import Site
from nanreplay.enums import FixKind
from nanreplay.numbers import num
from nanreplay.replay import Step, upstream
from nanreplay.replay.recorder import call_name


def diagnose(result, subject, step: Step, c: int | None, chain: list[int], *, verify_fixes: bool = True) -> dict:
    """The `diagnosis` object of the JSON contract, with fixes verified by replay."""
    info = getattr(result, "snapshot_info", None) or {}
    if c is None:
        return finite.diagnose_finite(result, subject, step if step.failure is None else None, info,
                                      verify_fixes=verify_fixes)
    site = Site(step, step.events[c], chain, subject, info)
    diag = RULES.answer(site)
    if verify_fixes:
        ref = plausible.Lazy(lambda: plausible.reference(info, step, subject))  # only when a replay is finite
        chosen, tried = _verify(diag, subject, ref, step, internal := [])
    else:
        internal = []
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
    if internal:
        out["internal_errors"] = internal
    return out


_ADVICE_FIRST = (FixKind.NORMALIZE_INPUT, FixKind.MASK_ROWS)  # causes a replay of this step cannot test (they are in the data)


class PatchMisplaced(Exception):  # noqa: N818 - raised inside a replay: the patch met another call than its own
    pass


def _landing(patch: dict | None, step: Step | None, landed: list[str]) -> dict | None:
    """The patch, each call's change applied only where the replay makes the call it was made for (the same
    function as in the analyzed replay at that number); elsewhere it raises PatchMisplaced — the numbering went
    wrong, a bug — instead of rewriting some other call ("'int' object has no attribute 'clamp'"). `landed`
    collects the ops (calls) each change did apply to."""
    if not patch or step is None:
        return patch
    names = step.call_names

    def guard(c: int, fn):
        want = names[c] if 0 <= c < len(names) else None

        def at(func, args, kwargs):
            got = call_name(func)
            if want is not None and got != want:
                raise PatchMisplaced(f"the patch for call {c} ({want}) met {got}: not the call it was made for")
            what = str(func) if isinstance(func, ti.OpOverload) else got
            if what not in landed:
                landed.append(what)
            return fn(func, args, kwargs)
        return at
    return {c: guard(c, fn) for c, fn in patch.items()}


def _verify(diag: Diagnosis, subject, ref: plausible.Lazy | None, step: Step | None = None,
            internal: list[str] | None = None) -> tuple[Fix, list[Fix]]:
    """Try each candidate fix in order; the first that is a no-op where the original was fine and whose replay
    is finite *and* plausible — against a reference of the same step first, the history only where there is
    none — wins; else the first. A candidate whose replay raises is nanreplay's bug (a fix it made broke the
    step's code, or landed on another call): said in `internal`, the analysis's warnings show it."""
    internal = [] if internal is None else internal
    tried = []
    same = plausible.SameStep()
    if step is not None and step.failure is not None and step.failure.what == "gradient":
        same.own = _finite_loss(step, subject)
    probes: dict = {}  # (kind, ε) -> the Outcome of an ε-probe replay: the next candidate (ε × 100) reuses it
    f64 = _reference(diag, subject, step)
    shared = _Shared(subject, step, diag)
    for fix in replay_order(diag.fixes):
        label = "with the fix"
        if fix.patch:
            label = ("with the rewritten line, at every call it makes" if fix.tested_as == "line" else
                     "with an op-level patch at the culprit's call (no line of yours is rewritten)")
            o = probes.pop((fix.kind, f"{fix.epsilon:.0e}"), None) if fix.epsilon is not None else None
            if o is None:
                o = verify.try_patch(subject, _landing(fix.patch, step, fix.patched_ops), label=label,
                                     noop=fix.noop_exempt is None, compare_at=fix.compare_at, reference=f64,
                                     shared=shared.get)
        elif fix.variant:
            v = fix.variant
            o = verify.try_variant(subject, dtype=v.get("dtype"), autocast=v.get("autocast", "same"),
                                   label=v.get("label", ""))
        else:
            fix.verification = fix.verification or "not replayed: not a code change at the culprit site"
            tried.append(fix)
            continue
        if o.ok and o.noop is not None and not o.noop.ok:
            ok, why = False, f"finite, but not a no-op: it {o.noop.sentence()}"
            fix.verified, fix.verification = False, f"{o.detail} — {why}"
        elif o.ok:
            ok, why = _judge(fix, o, subject, same, ref, probes, label, step, f64, shared.get)
            fix.verified = ok is not False  # not judged (nothing to compare with) is said, not hidden
            if o.noop is not None and (o.noop.elements or o.noop.faulting):
                why += f"; {o.noop.sentence()}"
            elif fix.noop_exempt:
                why += f"; not compared value by value with the original: {fix.noop_exempt}"
            fix.verification = f"{o.detail} — {why}"
            if ok and fix.kind in EXACT_KINDS and same.exact is None and o.loss is not None:
                same.exact = (f"the exact formulation ({fix.kind.value})", o.loss)
        else:
            ok, why = False, "the replay is not finite"
            fix.verified, fix.verification = False, o.detail
            if fix.kind in EXACT_KINDS and o.loss is not None and same.exact is None and o.noop is not None \
                    and o.noop.elements and o.noop.ok:  # its gradient broke, but its loss is this step's own
                same.exact = (f"the loss of the exact formulation ({fix.kind.value})", o.loss)
        fix.replay = {"loss": o.loss, "grad_norm": o.grad_norm, "plausible": ok, "why": why}
        if o.raised:
            internal.append(f"the {fix.kind.value} candidate ({fix.code.splitlines()[0][:120] if fix.code else ''}): "
                            f"{o.detail}")
        tried.append(fix)
        if fix.verified:  # a change of the step (bf16) that verifies only as "this batch is unusual" leaves the
            # advice the rule put first for a cause in the data (a batch 3000x too large) first; it is shown beside it
            data_first = diag.fixes[0].kind in _ADVICE_FIRST and plausible.UNUSUAL in why
            return (diag.fixes[0] if data_first else fix), tried
    code_fixes = [f for f in tried if f.verified is not None]
    if not code_fixes and diag.fixes and diag.fixes[0].kind not in (FixKind.NONE, FixKind.LOWER_LR_CLIP_GRADS, FixKind.MASK_ROWS):
        diag.fixes[0].verification = ("could not apply this fix automatically at the culprit call "
                                      "(the call is not spelled as expected); not verified")
    # none verified: advice the rule put first for a cause outside the step (the data) wins over a replayed patch
    if diag.fixes and diag.fixes[0].kind in _ADVICE_FIRST:
        return diag.fixes[0], tried
    # a remedy in the data the rule offered after its code changes wins where none of those verified
    data = next((f for f in diag.fixes[1:] if f.kind == FixKind.MASK_ROWS), None)
    if data is not None:
        why = next((f.verification for f in code_fixes if f.verification), None)
        if why:
            data.verification = f"{data.verification}; the code changes did not verify ({why})"
        return data, tried
    # else show the first that at least replayed finite (marked implausible), else the first tried
    finite_ones = [f for f in code_fixes if f.replay and f.replay.get("plausible") is False and f.replay.get("loss")
                   is not None and f.replay.get("why") != "the replay is not finite"]
    return (finite_ones[0] if finite_ones else code_fixes[0] if code_fixes else diag.fixes[0]), tried


class _Shared:
    """The forward up to the first call any candidate patches or compares at, run once for all of them
    (replay/upstream.py), built the first time a candidate replays; again after a failed candidate's instrumented
    replay released it; never where it cannot be shared."""

    def __init__(self, subject, step: Step | None, diag: Diagnosis):
        calls = [c for f in diag.fixes for p in (f.patch, f.probe, f.probe_down) for c in (p or {}) if isinstance(c, int)]
        calls += [c for f in diag.fixes for c in (f.compare_at or [])]
        self.subject, self.step, self.first = subject, step, min(calls, default=0)
        self.up: upstream.Upstream | None = None
        replays = sum(bool(f.patch) + bool(f.patch and f.probe) + bool(f.patch and f.compare_at) for f in diag.fixes)
        # worth it from the second replay on (the first pays for the shared part as it would for its own)
        self.never = not calls or step is None or not subject.program or replays < 2

    def get(self) -> upstream.Upstream | None:
        if self.up is not None and self.up.alive:
            return self.up
        if self.never:
            return None
        try:
            self.up = upstream.build(self.subject, self.step, self.first)
        except Exception:  # noqa: BLE001 - not shared: each candidate replays the whole step, as it would anyway
            self.up = None
        self.never = self.up is None
        return self.up


def replay_order(fixes: list[Fix]) -> list[Fix]:
    """The order candidates are replayed in: the rule's, except that an exact reformulation (EXACT_KINDS) goes
    first — it computes the step's own value, so its replay is the reference every ε after it is judged against
    (`SameStep.exact`), and where it verifies no other candidate is replayed. The rule's first fix stays the
    one shown when none verifies."""
    return sorted(fixes, key=lambda f: f.kind not in EXACT_KINDS)


def _reference(diag: Diagnosis, subject, step: Step | None) -> verify.Float64Reference:
    """The float64 values of this step at every call any candidate patches or compares at: one forward, made the
    first time a candidate's no-op check needs it (never, where every change is within rounding)."""
    calls: set[int] = set()
    for fix in diag.fixes:
        for p in (fix.patch, fix.probe):
            calls.update(c for c in (p or {}) if isinstance(c, int))
        calls.update(fix.compare_at or [])
    return verify.Float64Reference(subject, calls, step.call_names if step is not None else None)


def _finite_loss(step: Step, subject) -> float | None:
    v = step.loss
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v) / (subject.loss_scale or 1.0)
    return None


def _judge(fix: Fix, o: verify.Outcome, subject, same: plausible.SameStep, ref: plausible.Lazy | None,
           probes: dict, label: str, step: Step | None = None, f64: verify.Float64Reference | None = None,
           shared=None) -> tuple[bool | None, str]:
    """Plausible? An exact reformulation that is a no-op where the original was fine computes this step's own
    value; any other fix must agree with the references of the same step there are (that exact loss, the step's
    own finite loss, and — only where the no-op check could not be made — the same fix at ε × 100: an ε whose
    no-op check passed changes nothing the original computed fine, so a larger ε that clamps healthy values says
    nothing about it); only with none of those is the history asked. Where the same step says yes and the history
    says no, the batch is unusual, and that is said."""
    history = ref.get() if ref is not None else None
    if fix.kind in EXACT_KINDS and fix.patch and o.noop is not None and o.noop.elements:
        return True, ("plausible against the same step: an exact reformulation of it, equal to the original "
                      "wherever the original was finite" + plausible.unusual_batch(o.loss, history))
    probe_loss, note, update, other = None, "", "", None
    checked = o.noop is not None and (o.noop.elements > 0 or o.noop.faulting > 0) and o.noop.ok
    if fix.probe and fix.epsilon is not None:
        # the probe's no-op check is read only where its loss and the candidate's disagree (below), and by the
        # candidate at ε × 100 that reuses it: its float64 reference (a forward of its own) is deferred to then
        deferred = noop.Deferred() if f64 is not None and not f64.made else None
        p = verify.try_patch(subject, _landing(fix.probe, step, []), label=label, noop=fix.noop_exempt is None,
                             compare_at=fix.compare_at, reference=deferred or f64, shared=shared)
        if deferred is not None and deferred.asked and p.ok and p.loss is not None and o.loss is not None \
                and not plausible.agree(o.loss, p.loss):  # read below: the same replay, checked against float64
            p = verify.try_patch(subject, _landing(fix.probe, step, []), label=label, noop=fix.noop_exempt is None,
                                 compare_at=fix.compare_at, reference=f64, shared=shared)
            deferred = None
        if deferred is None or not deferred.asked or not p.ok and fix.kind not in EXACT_KINDS:  # (a failed ε
            # candidate's check is never read: _verify)
            probes[(fix.kind, f"{fix.epsilon * 100:.0e}")] = p  # the same replay as the candidate at ε × 100
        probe_loss = p.loss if p.ok else None
        if probe_loss is not None and checked and p.noop is not None and not p.noop.ok and o.loss is not None \
                and not plausible.agree(o.loss, probe_loss):
            # ε × 100 that changes values the original computed fine is no reference for an ε that does not: ε / 100
            # is (it moves nothing the candidate does not), where the dtype still resolves it
            unused = (f"; the loss at ε = {fix.epsilon * 100:.0e} ({num(probe_loss)}) is no reference: "
                      f"that ε {p.noop.sentence()}")
            shown = probes.get(("depends on ε", fix.kind))
            if shown:  # a smaller ε already showed it, with a probe that was a no-op
                return False, f"finite but implausible against the same step: {shown}{unused}"
            q = verify.try_patch(subject, _landing(fix.probe_down, step, []), label=label, compare_at=fix.compare_at,
                                 reference=f64, shared=shared) if fix.probe_down else None
            # where ε / 100 cannot answer (not resolved by the dtype: not finite), ε × 100 stands as the evidence
            if q is not None and q.ok and q.loss is not None and q.noop is not None and q.noop.ok:
                probe_loss, note = None, unused
                if not plausible.agree(o.loss, q.loss) and _few_broken(o) and _same_update(o, q):
                    update, other = _constant_sentence(o, q, fix.epsilon, fix.epsilon / 100) + note, q.loss
                elif not plausible.agree(o.loss, q.loss):
                    return False, (f"finite but implausible against the same step: the loss moves when ε shrinks by two "
                                   f"decades ({num(o.loss)} at ε = {fix.epsilon:.0e}, {num(q.loss)} at ε = "
                                   f"{fix.epsilon / 100:.0e}){note}")
                else:
                    note = (f"; the loss does not move when ε shrinks by two decades ({num(q.loss)} at ε = "
                            f"{fix.epsilon / 100:.0e})" + note)
        elif probe_loss is not None and o.loss is not None and not plausible.agree(o.loss, probe_loss) and checked \
                and p.noop is not None and p.noop.ok and _few_broken(o) and _same_update(o, p):
            # both no-ops where the original was fine, the loss moves with ε and the update does not: the broken
            # elements' value is a constant of ε that trains nothing
            update, other, probe_loss = _constant_sentence(o, p, fix.epsilon, fix.epsilon * 100), p.loss, None
        elif probe_loss is not None and o.loss is not None and not plausible.agree(o.loss, probe_loss):
            # both no-ops where the original was fine: the loss moves with ε through the broken values alone
            probes[("depends on ε", fix.kind)] = (
                f"the loss moves when ε changes by two decades ({num(o.loss)} at ε = {fix.epsilon:.0e}, "
                f"{num(probe_loss)} at ε = {fix.epsilon * 100:.0e}, both no-ops where the original was fine): it "
                "depends on ε where the original broke, so no ε is the step's own value")
    ok, why = plausible.judge_same_step(o.loss, same, probe_loss, fix.epsilon if probe_loss is not None else None)
    if update and ok is not False:  # the update is the step's own; the loss, ε's part in it included, must still
        # be plausible against a reference that is not ε's (the history, this step's finite parts), at both ε:
        # log(ε) stays there over two decades, x / ε does not
        g, gwhy = plausible.judge(o.loss, o.grad_norm, o.grad_norms, history)
        g2, why2 = plausible.judge(other, o.grad_norm, o.grad_norms, history)
        if g is True and g2 is not True:
            g, gwhy = g2, f"at the other ε, {why2}"
        if g is not True:
            return False, f"finite but implausible: {update}; {gwhy}"
        return True, f"plausible against the same step: {update}; {gwhy}" + \
            (f"; {why[len('plausible against the same step: '):]}" if ok else "")
    if ok is None:
        ok, why = plausible.judge(o.loss, o.grad_norm, o.grad_norms, history)
        if ok is None and fix.kind == FixKind.POSITIVE_PARAMETRISATION:  # another model (softplus for relu): its
            return False, (f"finite, but not judged: {why}; a changed model needs a reference (the run's history "
                           "or this step's finite parts) to be called plausible")  # finite replay alone is no evidence
        wider = fix.variant or fix.kind == FixKind.FLOAT32_SOFTMAX  # float32 where float16 overflowed, the rest kept
        if ok is False and wider and o.loss is not None:  # a wider dtype computes what the step meant: the
            if "float64" not in probes:                          # same step in float64 says so, not the history
                probes["float64"] = plausible.float64_loss(subject)
            f64 = probes["float64"]
            dt = (fix.variant.get("dtype") or (fix.variant.get("autocast") or {}).get("dtype")) if fix.variant \
                else torch.float16
            tol = max(plausible.SAME_RTOL, 8 * torch.finfo(dt).eps) if isinstance(dt, torch.dtype) else \
                plausible.SAME_RTOL
            if f64 is not None and abs(abs(o.loss) - f64) <= tol * f64 + plausible.SAME_ATOL:
                ok, why = True, (f"plausible against the same step in float64: loss {num(o.loss)} ≈ {num(f64)} "
                                 f"(within {tol:.2g})" + plausible.unusual_batch(o.loss, history))
    elif ok:
        why += plausible.unusual_batch(o.loss, history)
    return ok, why + note


def _few_broken(o: verify.Outcome) -> bool:
    """At most BROKEN_FEW of the patched calls' values broke (NaN/Inf, or a finite value whose derivative was not)."""
    n = o.noop
    return n is not None and n.total > 0 and (n.total - n.elements) <= BROKEN_FEW * n.total


BROKEN_FEW = 0.25


def _same_update(a: verify.Outcome, b: verify.Outcome) -> bool:
    """The two replays step with the same gradient: every parameter's gradient norm within SAME_RTOL (a norm, not
    the vector: a change confined to the direction of a parameter's gradient would pass unseen)."""
    ga, gb = a.grad_norms, b.grad_norms
    if not ga or not gb or ga.keys() != gb.keys():
        return False
    total = max(a.grad_norm or 0.0, b.grad_norm or 0.0)
    return all(abs(ga[k] - gb[k]) <= plausible.SAME_RTOL * max(ga[k], gb[k]) + 1e-6 * total for k in ga)


def _constant_sentence(o: verify.Outcome, p: verify.Outcome, eps: float, eps2: float) -> str:
    return (f"the loss moves when ε changes by two decades ({num(o.loss)} at ε = {eps:.0e}, {num(p.loss)} at ε = "
            f"{eps2:.0e}, both no-ops where the original was fine) but no parameter's gradient does (each norm "
            f"within {plausible.SAME_RTOL:g}): ε sets only a constant of the loss where the original broke, not the "
            "update")


def for_leaves(verdict: str, rows: list[dict], snap) -> dict:
    """Diagnosis when NaN/Inf was already in the batch or the weights: nothing to replay."""
    names = ", ".join(f"{r['name']} ({r['nan']} NaN, {r['inf']} Inf)" for r in rows[:5])
    if verdict == "nonfinite_input":
        samples = sorted({i for r in rows for i in r.get("samples", [])})
        first = rows[0]["name"] if rows else "x"
        x = first if first.isidentifier() else "x"  # the batch tensor's own name where it is one (`images`)
        at = f" Bad samples (index along dim 0): {samples[:20]}." if samples else ""
        check = f"assert torch.isfinite({x}).all(), f'non-finite input in batch {{step}}'"
        rw = datafix.batch_filter((getattr(snap, "raw", None) or {}).get("entry"), getattr(snap, "inputs", None),
                                  getattr(snap, "target", None), samples) if snap is not None else None
        why = "the batch itself is non-finite: nothing in the model to replay"
        fix = Fix(FixKind.CLEAN_INPUT, "", rewrite=rw, verification=why,
                  reasoning=("The root is in the data: find where these samples are made. As a stopgap the edit "
                             "leaves them out of the batch on the line that hands it to the guard; a healthy batch "
                             "passes unchanged."),
                  alternatives=[check, f"{x} = torch.nan_to_num({x})  # hides the bad values: train on them as 0"]) \
            if rw is not None else \
            Fix(FixKind.CLEAN_INPUT, f"{check}\n# find the source in the data pipeline; as a stopgap: "
                f"{x} = torch.nan_to_num({x})", verification=why)
        return {"cause": "nonfinite_input", "title": "NaN/Inf in the input batch",
                "explanation": f"The batch already holds non-finite values before the model runs: {names}.{at} "
                               "The model is not the culprit; the data pipeline is (a log of 0 or a division by 0 "
                               "in preprocessing, a corrupt record, a missing value read as NaN).",
                "fix": fix.to_json(), "candidates": []}
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
