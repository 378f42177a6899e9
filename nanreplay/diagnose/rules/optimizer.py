"""Failures inside `optimizer.step()`: the update that broke the weights.

These rules answer only for culprits in phase "optimizer" (an update snapshot's replayed update)
and claim every such culprit before any forward/backward rule could: their priorities sit above
all others, and the last of them (`optimizer_update`) answers for any update. In order:

* `nonfinite_lr` — the learning rate itself is NaN/Inf (a scheduler that returned inf/nan);
* `nonfinite_optimizer_state` — the state (momentum, moments) was NaN/Inf before the update;
* `optimizer_eps` — eps below the dtype's resolution: it rounds to 0 next to a second moment that
  underflowed to 0, and the update divides by 0 (Adam with `.half()` weights and eps=1e-8);
* `update_overflow` — a finite update that takes weights beyond the dtype's range (lr × step);
* `optimizer_kernel_path` — the foreach/fused kernel breaks where the single-tensor path does not;
* `optimizer_update` — what the op did, with the numbers, and no fix rather than a wrong one.

Fixes carry `variant={"update": {...}}`: a change `replay.update.try_update` replays (another
eps, lr, dtype, reset state, clipped gradients); `diagnose/update.py` verifies them.
"""

from __future__ import annotations

import math
import os

import torch

from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.prose import count
from nanreplay.diagnose.update_site import UpdateSite, denominator_key, g, is_update_site
from nanreplay.enums import FixKind
from nanreplay.replay.update import run_update, try_update


def where(s: UpdateSite) -> str:
    fr = s.step.frame_of(s.event)
    at = ""
    if fr is not None:
        code = s.source.get("code") if s.source else None
        at = f" ({os.path.basename(fr[0])}:{fr[1]}" + (f": `{code}`" if code else "") + ")"
    return f"{s.event.op} inside {s.us.cls}.step(){at}"


def _made(s: UpdateSite) -> str:
    return f"wrote NaN/Inf into {s.broken_sentence()}"


@rule("nonfinite_lr", priority=1050)
def _nonfinite_lr(s: UpdateSite) -> Diagnosis | None:
    if not is_update_site(s):
        return None
    bad = s.nonfinite_lrs()
    if not bad:
        return None
    sched = s.us.scheduler
    by = ""
    if sched:
        by = (f", set by the scheduler {sched['class']} (its last learning rates {[g(x) for x in sched.get('last_lr') or []]}"
              + (f" at epoch {sched['last_epoch']}" if sched.get("last_epoch") is not None else "")
              + (f"; base {[g(x) for x in sched['base_lrs']]}" if sched.get("base_lrs") else "") + ")")
    groups = ", ".join(f"group {i}: lr = {lr}" for i, lr in bad)
    good = s.last_finite_lr()
    expl = (f"The learning rate is not finite when the update runs ({groups}){by}. Every step is multiplied by it, "
            f"so {where(s)} {_made(s)} — Inf where the step is non-zero, NaN where it is 0 (0 × inf). The gradients "
            "and the weights before the update are finite: the schedule is the bug (a warmup or decay factor that "
            "divides by zero or overflows at this epoch).")
    fixes = []
    if good is not None:
        lr, why = good
        cap = _schedule_cap(s)
        fixes.append(Fix(FixKind.LR_SCHEDULE,
                         f"# keep the schedule's factor finite (check it at this epoch); until then:\n"
                         f"for group in optimizer.param_groups:\n    group['lr'] = {lr:g}  # {why}",
                         variant={"update": {"group_hyper": {i: {"lr": lr} for i, _ in bad}},
                                  "label": f"with lr = {lr:g} ({why})"},
                         reasoning="a finite learning rate, as the schedule gave before it broke",
                         settings={"schedule_cap": cap, "lr": lr} if cap is not None else None))
    else:
        fixes.append(Fix(FixKind.LR_SCHEDULE, "assert all(math.isfinite(lr) for lr in scheduler.get_last_lr())",
                         reasoning="no finite learning rate is known to replay with"))
    return Diagnosis("nonfinite_lr", "the learning rate is NaN/Inf (scheduler)", expl, fixes)


def _schedule_cap(s: UpdateSite) -> float | None:
    """The largest factor the schedule gave (lr / the configured lr) on the steps the history logged finite: a
    LambdaLR clamped to it gives every healthy step its rate and this one a finite rate (diagnose/edits/sitefix.py)."""
    factors = [float(r["lr"]) / float(r["base_lr"]) for r in s.us.history
               if isinstance(r.get("lr"), (int, float)) and isinstance(r.get("base_lr"), (int, float))
               and math.isfinite(r["lr"]) and math.isfinite(r["base_lr"]) and r["lr"] > 0 and r["base_lr"] > 0]
    return max(factors) if factors else None


@rule("nonfinite_optimizer_state", priority=1040)
def _nonfinite_state(s: UpdateSite) -> Diagnosis | None:
    if not is_update_site(s):
        return None
    bad = s.nonfinite_state()
    if not bad:
        return None
    names = sorted({n for n, *_ in bad})
    listed = ", ".join(f"{k} of {n} ({nan} NaN, {inf} Inf)" for n, k, nan, inf in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    expl = (f"The optimizer state was already NaN/Inf before this update: {listed}{more}. The gradients and the "
            f"weights were finite; {where(s)} read that state and {_made(s)}. State goes bad when a checkpoint "
            "saved after a broken step is resumed, or when state from another run or model is loaded.")
    code = ("# restore the optimizer state from the last good checkpoint, or reset the broken entries:\n"
            "params = dict(model.named_parameters())\n"
            f"for name in {names!r}:\n"
            f"    optimizer.state[params[name]].clear()  # {', '.join(sorted({k for _, k, *_ in bad}))}: starts afresh")
    return Diagnosis("nonfinite_optimizer_state", "the optimizer state was already NaN/Inf", expl,
                     [Fix(FixKind.RESTORE_OPTIMIZER_STATE, code,
                          variant={"update": {"reset": names}, "label": f"with the state of {', '.join(names)} reset"},
                          reasoning="the broken state entries, started afresh from this step's gradient")])


def _fp32_fix(s: UpdateSite, kind: FixKind) -> Fix:
    code = (f"model = model.float()  # float32 master weights: {s.us.cls}'s state is float32 too\n"
            f"{s.optimizer_call()}\n"
            "scaler = torch.amp.GradScaler()\n"
            "with torch.autocast('cuda', dtype=torch.float16):  # the forward still runs in float16\n"
            "    loss = loss_fn(model(x), y)")
    return Fix(kind, code, variant={"update": {"dtype": torch.float32}, "label": "with float32 weights and state"},
               reasoning="mixed precision keeps the weights and the optimizer in float32 and only computes in float16")


@rule("optimizer_eps", priority=1030)
def _eps(s: UpdateSite) -> Diagnosis | None:
    if not is_update_site(s):
        return None
    eps = s.hyper.get("eps")
    key = denominator_key(s.us.cls, s.hyper)
    v = s.state_after(key) if key else None
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0 or v is None:
        return None
    fi = torch.finfo(v.dtype)
    in_dtype = float(torch.tensor(float(eps), dtype=v.dtype))
    if in_dtype != 0.0 and eps >= fi.tiny:
        return None
    at = s.at_bad(v)
    if at is None or not at.numel():
        return None
    zeros = int((at == 0).sum())
    if zeros * 2 < at.numel():
        return None
    dt = str(v.dtype).removeprefix("torch.")
    sub = fi.tiny * fi.eps
    rounded = "rounds to 0" if in_dtype == 0.0 else f"is a subnormal {dt} number ({g(in_dtype)}, with few significant bits)"
    gb = s.grad_at_bad()
    gmax = float(gb.abs().max()) if gb is not None and gb.numel() else math.nan
    m = s.at_bad(s.state_after("exp_avg"))
    m_nz = f" ({int((m != 0).sum())} of them non-zero)" if m is not None else ""
    betas = s.hyper.get("betas") or [0.9, 0.999]
    b2 = float(betas[1]) if isinstance(betas, (list, tuple)) and len(betas) == 2 else 0.999
    under = math.sqrt(sub / 2 / (1 - b2)) if b2 < 1 else math.nan
    expl = (f"{s.us.cls}'s eps = {g(float(eps))} is below {dt}'s resolution: {dt}'s smallest positive number is "
            f"{g(sub)} (smallest normal {g(fi.tiny)}), so eps {rounded} inside the update. Where a gradient is tiny "
            f"the second moment {key} underflows to 0 as well: (1-β2)·g² is below {g(sub)} for |g| < {g(under)}. "
            f"At the {at.numel()} NaN/Inf entries of {s.param}, {key} is 0 after the update ({zeros} of "
            f"{at.numel()}) and |g| is at most {g(gmax)}: the denominator sqrt({key})+eps is 0, and {where(s)} "
            f"divides the first moment{m_nz} by it — Inf, or NaN where the first moment is 0 too. "
            f"In all, the update {_made(s)}.")
    start = 10.0 ** math.ceil(math.log10(fi.tiny))
    fixes = [Fix(FixKind.OPTIMIZER_EPS, s.optimizer_call(eps=e) + f"  # an eps {dt} represents", epsilon=e,
                 variant={"update": {"hyper": {"eps": e}}, "label": f"with eps={e:g}"}, settings={"eps": e},
                 reasoning=f"eps ≥ {dt}'s smallest normal number {g(fi.tiny)} survives the rounding and keeps the "
                           "denominator away from 0")
             for e in (start, start * 10, start * 100) if e < 1.0]
    fixes.append(_fp32_fix(s, FixKind.OPTIMIZER_EPS))
    return Diagnosis("optimizer_eps", f"{s.us.cls} eps below {dt}'s resolution", expl, fixes)


@rule("update_overflow", priority=1020)
def _overflow(s: UpdateSite) -> Diagnosis | None:
    if not is_update_site(s) or s.event.kind != "inf" or s.event.role != "origin":
        return None
    try:
        wide = run_update(s.us.changed(dtype=torch.float64))
    except Exception:  # noqa: BLE001 - no float64 kernel: not this rule's call
        return None
    if not wide.finite or not s.pdtype.is_floating_point:
        return None
    fmax = torch.finfo(s.pdtype).max
    reach = s.at_bad(wide.after[s.param])
    if reach is None or not reach.numel() or float(reach.abs().max()) <= fmax:
        return None
    size = wide.change(s.us.lost)
    step = s.at_bad(wide.after[s.param] - wide.before[s.param])
    gb = s.grad_at_bad()
    lr = s.lr()
    dt = s.pdtype_name
    smax = float(step.abs().max())
    gmax = float(gb.abs().max()) if gb is not None and gb.numel() else math.nan
    by = f" (lr = {g(lr)} × a gradient of up to {g(gmax)})" if lr is not None else ""
    if smax > fmax:
        how = f"the step alone is up to {g(smax)}{by}, beyond {dt}'s largest value {g(fmax)}"
    else:
        known = s.at_bad(wide.before[s.param])
        lost = s.at_bad(s.us.lost.get(s.param))
        if lost is not None and known is not None:
            known = known[~lost]
        w = f"weights of up to {g(float(known.abs().max()))}" if known is not None and known.numel() else "the weights"
        how = (f"the step is up to {g(smax)}{by}, and it takes {w} to {g(float(reach.abs().max()))}, beyond "
               f"{dt}'s largest value {g(fmax)}")
    expl = (f"The update itself is finite but too large for {dt}: at the {reach.numel()} NaN/Inf entries of "
            f"{s.param} {how}. {where(s)} {_made(s)}. This update is {g(size['ratio'])}× the weights' norm: the "
            "learning rate (or the warmup's first steps) is far too large for these gradients; clipping bounds "
            "the gradient's norm.")
    fixes = []
    if lr is not None and lr > 0 and size["ratio"] > 0:
        new = 10.0 ** math.floor(math.log10(lr * 0.05 / size["ratio"]))
        for cand in (new, new / 10):
            if cand < lr:
                fixes.append(Fix(FixKind.LOWER_LR_CLIP_GRADS, s.optimizer_call(lr=cand) + f"  # was lr={g(lr)}",
                                 variant={"update": {"hyper": {"lr": cand}}, "label": f"with lr={cand:g}"},
                                 settings={"lr": cand},
                                 reasoning=f"lr scaled so that this update moves the weights by about 5% of their "
                                           f"norm instead of {g(size['ratio'])}×"))
    total = math.sqrt(sum(float(t.double().pow(2).sum()) for t in s.us.grads.values()))
    if math.isfinite(total) and total > 1.0:
        fixes.append(Fix(FixKind.LOWER_LR_CLIP_GRADS,
                         "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # before optimizer.step()",
                         variant={"update": {"clip": 1.0}, "label": "with the gradients clipped to norm 1"},
                         reasoning=f"the gradient norm is {g(total)}; clipping it to 1 bounds the step"))
    if s.pdtype in (torch.float16, torch.bfloat16):
        fixes.append(_fp32_fix(s, FixKind.LOWER_LR_CLIP_GRADS))
    if not fixes:
        fixes.append(Fix(FixKind.LOWER_LR_CLIP_GRADS, "# lower the learning rate and clip the gradients"))
    return Diagnosis("update_overflow", f"the update overflows {dt}", expl, fixes)


@rule("optimizer_kernel_path", priority=1015)
def _kernel_path(s: UpdateSite) -> Diagnosis | None:
    if not is_update_site(s) or s.upd.implementation == "single_tensor":
        return None
    ref = try_update(s.us, "on the single-tensor path", implementation="single_tensor")
    if not ref.ok:
        return None
    flag = "fused" if s.upd.implementation == "fused" else "foreach"
    expl = (f"The {s.upd.implementation} kernel of {s.us.cls} {_made(s)} ({where(s)}), but the same update on "
            f"torch's single-tensor reference path gives finite weights ({ref.detail.split(': ', 1)[-1]}). The "
            f"{flag} implementation differs from the reference here: report it to PyTorch with this snapshot, and "
            f"use {flag}=False until it is fixed.")
    return Diagnosis("optimizer_kernel_path", f"the {flag} optimizer kernel differs from the reference", expl,
                     [Fix(FixKind.OPTIMIZER_IMPLEMENTATION, s.optimizer_call(**{flag: False}),
                          variant={"update": {"implementation": "single_tensor"},
                                   "label": "on the single-tensor path"},
                          reasoning="the reference implementation of the same update")])


@rule("optimizer_update", priority=1010)
def _any_update(s: UpdateSite) -> Diagnosis | None:
    """Any other culprit inside the update: what it did, with the values, and no fix rather than a wrong one."""
    if not is_update_site(s):
        return None
    lr = s.lr()
    parts = []
    for key, v in sorted(s.upd.state_after.get(s.param, {}).items()):
        at = s.at_bad(v)
        if at is not None and at.numel() and at.is_floating_point():
            parts.append(f"{key} in [{g(float(at.min()))}, {g(float(at.max()))}]")
    gb = s.grad_at_bad()
    if gb is not None and gb.numel():
        parts.append(f"gradient in [{g(float(gb.min()))}, {g(float(gb.max()))}]")
    vals = f" At those entries: {', '.join(parts)}." if parts else ""
    bad_grads = [n for n, t in s.us.grads.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad_grads:
        vals += (f" The gradients it used were already NaN/Inf ({', '.join(bad_grads[:5])}): the step broke before "
                 "the update — guard.grads_ok() before optimizer.step() catches it there.")
    expl = (f"{where(s)} made {count(int(s.bad.sum()), 'NaN/Inf entry')} of {s.param} (role {s.event.role}) with "
            f"lr = {g(lr) if lr is not None else '?'} in {s.pdtype_name}.{vals} In all, the update {_made(s)}. "
            "nanreplay has no specific rule for this pattern inside the optimizer, so it suggests no fix rather than "
            "a wrong one.")
    return Diagnosis("optimizer_update", f"{s.event.op} broke the weights inside {s.us.cls}.step()", expl,
                     [Fix(FixKind.NONE, "# no automatic suggestion for this pattern")])
