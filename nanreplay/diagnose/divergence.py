"""Reading the snapshot's history: did training diverge, and from which step; what to clip at.

`snapshot_info.history` holds {step, loss, grad_norm} for the steps before the snapshot. A run
diverges when, after some healthy steps, the loss or the gradient norm climbs by orders of
magnitude and stays up. The healthy steps' gradient norm is the number to clip at; the step the
climb started at says how long a warmup (or how early a checkpoint) is needed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from nanreplay.diagnose.model import Fix
from nanreplay.diagnose.plausible import history_rows
from nanreplay.diagnose.site import finite_float
from nanreplay.enums import FixKind

LOSS_CLIMB = 10.0  # the last loss at least this many times the healthy minimum ...
NORM_CLIMB = 100.0  # ... or the last gradient norm at least this many times the healthy median


LR_JUMP = 100.0  # a learning rate this many times every rate the history had before it is a jump, not a schedule


@dataclass
class LrJump:
    """The learning rate jumped between two steps of the history (a scheduler bug, a manual edit, a resumed state)."""
    step: int  # the first step at the new rate
    before: float  # the rate the history had before it (the median of the earlier steps')
    after: float
    healthy_steps: tuple[int, int]  # the steps at the earlier rate

    @property
    def sentence(self) -> str:
        a, b = self.healthy_steps
        return (f"the learning rate jumped from {self.before:g} (steps {a}–{b}) to {self.after:g} at step {self.step} "
                f"({self.after / self.before:.3g}×)")


def lr_jump(info: dict) -> LrJump | None:
    """A jump in the history's learning rate: a step whose rate is at least LR_JUMP × every rate of the two or more
    steps before it, and above the configured rate (a warmup climbs to the configured rate, never past it)."""
    rows = history_rows(info)
    lrs = [(r.get("step", i), v) for i, r in enumerate(rows) if (v := finite_float(r.get("lr"))) is not None]
    base = next((v for r in reversed(rows) if (v := finite_float(r.get("base_lr"))) is not None), None)
    for k in range(2, len(lrs)):
        prev = [v for _, v in lrs[:k] if v > 0]
        s, v = lrs[k]
        if len(prev) >= 2 and v >= LR_JUMP * max(prev) and (base is None or v > 2 * base):
            return LrJump(s, statistics.median(prev), v, (lrs[0][0], lrs[k - 1][0]))
    return None


@dataclass
class Divergence:
    onset: int  # the first step of the climb
    loss: tuple[tuple[int, float], tuple[int, float]] | None  # (step, loss) healthy minimum, peak after the onset
    grad_norm: tuple[tuple[int, float], tuple[int, float]] | None  # (step, norm) healthy median, peak
    healthy_grad_norm: float | None  # median gradient norm of the steps before the climb
    healthy_steps: tuple[int, int] | None
    lr_at_onset: float | None = None  # the learning rate the schedule gave at the onset
    base_lr: float | None = None  # the configured learning rate (the scheduler's initial_lr)
    clip: float | None = None  # the max_norm gradients were already clipped to
    jump: LrJump | None = None  # the learning rate jumped before the climb (or before the failure, with no climb)

    @property
    def story(self) -> str:
        parts = [self.jump.sentence] if self.jump else []
        if self.loss:
            (s0, a), (s1, b) = self.loss
            parts.append(f"the loss climbed from {a:.3g} (step {s0}) to {b:.3g} (step {s1})")
        if self.grad_norm:
            (s0, a), (s1, b) = self.grad_norm
            parts.append(f"the gradient norm from {a:.3g} to {b:.3g} (step {s1})")
        lr = f" (learning rate {self.lr_at_onset:.3g})" if self.lr_at_onset is not None and not self.jump else ""
        if self.jump and not (self.loss or self.grad_norm):
            return parts[0] + ", and the next update broke the weights"
        return " and ".join(parts) + f", starting at step {self.onset}{lr}"

    def to_json(self) -> dict:
        return {"onset_step": self.onset,
                "loss": [{"step": s, "loss": v} for s, v in self.loss] if self.loss else None,
                "grad_norm": [{"step": s, "grad_norm": v} for s, v in self.grad_norm] if self.grad_norm else None,
                "healthy_grad_norm": self.healthy_grad_norm,
                "healthy_steps": list(self.healthy_steps) if self.healthy_steps else None,
                "lr_at_onset": self.lr_at_onset, "base_lr": self.base_lr, "clip": self.clip,
                "lr_jump": {"step": self.jump.step, "before": self.jump.before, "after": self.jump.after}
                if self.jump else None}


def _series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r.get("step", i), v) for i, r in enumerate(rows) if (v := finite_float(r.get(key))) is not None]


def divergence(info: dict) -> Divergence | None:
    """The climb in the snapshot's history, or None when the history is short or healthy. A climb is the peak
    after the onset orders of magnitude above the steps before it, whatever follows: a loss that climbs and then
    oscillates, or falls back a little, diverged all the same. A learning rate that jumped (`lr_jump`) is a
    divergence too, from the jump on, even where the loss had no step to climb in before the weights broke."""
    rows = history_rows(info)
    if len(rows) < 3:
        return None
    jump = lr_jump(info)
    d = _climb(rows)
    if jump is None:
        return d
    if d is None:
        norms = [v for s, v in _series(rows, "grad_norm") if s < jump.step]
        return Divergence(jump.step, None, None, statistics.median(norms) if norms else None, jump.healthy_steps,
                          jump.after, _base(rows), None, jump)
    d.jump = jump
    return d


def _base(rows: list[dict]) -> float | None:
    return next((v for r in reversed(rows) if (v := finite_float(r.get("base_lr"))) is not None), None)


def _climb(rows: list[dict]) -> Divergence | None:
    losses, norms = _series(rows, "loss"), _series(rows, "grad_norm")
    onset = None
    for i, r in enumerate(rows[1:], 1):
        lo = [v for s, v in losses if s < r.get("step", i)]
        gn = [v for s, v in norms if s < r.get("step", i)]
        loss, norm = finite_float(r.get("loss")), finite_float(r.get("grad_norm"))
        if (loss is not None and lo and min(lo) > 0 and loss > 2 * min(lo)) or \
                (norm is not None and gn and norm > 10 * statistics.median(gn)):
            onset = r.get("step", i)
            break
    if onset is None:
        return None
    healthy_l = [(s, v) for s, v in losses if s < onset]
    healthy_g = [(s, v) for s, v in norms if s < onset]
    later_l = [(s, v) for s, v in losses if s >= onset]
    later_g = [(s, v) for s, v in norms if s >= onset]
    loss = grad = None
    if healthy_l and later_l:
        low = min(healthy_l, key=lambda sv: sv[1])
        peak = max(later_l, key=lambda sv: sv[1])
        if low[1] > 0 and peak[1] >= LOSS_CLIMB * low[1]:
            loss = (low, peak)
    med = statistics.median(v for _, v in healthy_g) if healthy_g else None
    if med and later_g:
        peak = max(later_g, key=lambda sv: sv[1])
        if peak[1] >= NORM_CLIMB * med:
            grad = ((healthy_g[0][0], med), peak)
    if loss is None and grad is None:
        return None
    steps = [s for s, _ in healthy_l + healthy_g]
    at = next((r for i, r in enumerate(rows) if r.get("step", i) == onset), {})
    before = [r for i, r in enumerate(rows) if r.get("step", i) <= onset]
    base = next((v for r in reversed(rows) if (v := finite_float(r.get("base_lr"))) is not None), None)
    clip = next((v for r in reversed(before) if (v := finite_float(r.get("clip"))) is not None), None)
    return Divergence(onset, loss, grad, med, (min(steps), max(steps)) if steps else None,
                      finite_float(at.get("lr")), base, clip)


def clip_value(x: float) -> float:
    """A clip threshold from a gradient norm: two significant digits."""
    return float(f"{x:.2g}")


TYPO_LR = 1e3  # no optimizer trains at a learning rate this high: a configured one is a typo (2e5 for 2e-5)


def _typo(lr: float) -> str | None:
    """'2e-05' for 2e5: the same digits with the exponent's sign flipped, where that is what was meant."""
    if lr < TYPO_LR:
        return None
    mant, exp = f"{lr:e}".split("e")
    return f"{float(mant):g}e-{int(exp):02d}"


def remedy(d: Divergence) -> str:
    """What to change, in a few words, from the history: a typo'd learning rate; a lower one where gradients are
    already clipped; else a lower one (or a warmup) and clipping."""
    if d.jump:
        return (f"set the learning rate back to {d.jump.before:g}, the rate the history trained at: what changed it "
                f"at step {d.jump.step} is the bug")
    typo = _typo(d.base_lr) if d.base_lr is not None else None
    if typo:
        return f"the configured learning rate {d.base_lr:g} is a typo (for {typo}, most likely): fix it"
    if d.clip is not None:
        return (f"lower the learning rate (or warm it up) — gradients were already clipped at {d.clip:g}, so "
                "clipping is not the remedy")
    return "lower the learning rate (or warm it up), clip gradients"


def sgd_lr_bound(info: dict, d: Divergence | None) -> tuple[float, float, int, int, float] | None:
    """(the largest stable rate, the growth, its two steps, the rate) for plain SGD, from the history's first climb.

    Gradient descent multiplies the gradient along a direction of curvature λ by |1 - lr·λ| each step: a norm that
    grew r× in one step at rate lr has some λ ≥ (1 + r) / lr, and SGD is stable along it only for lr < 2 / λ — so at
    most 2·lr / (1 + r). Momentum only widens that bound, so it stays safe; Adam normalises the step (no bound)."""
    opt = info.get("optimizer") if isinstance(info.get("optimizer"), dict) else {}
    if d is None or d.jump is not None or opt.get("class") != "SGD":
        return None
    rows = history_rows(info)
    pts = [(r.get("step", i), finite_float(r.get("grad_norm")), finite_float(r.get("lr"))) for i, r in enumerate(rows)]
    for (s0, g0, lr0), (s1, g1, lr1) in zip(pts, pts[1:], strict=False):
        if s1 == d.onset and s0 == s1 - 1 and g0 and g1 and lr0 and lr0 == lr1 and g1 > 2 * g0:
            r = g1 / g0  # a clear growth, not one batch's noise
            return 2 * lr0 / (1 + r), r, s0, s1, lr0
    return None


def _below(x: float) -> float:
    """Half of `x`, rounded down to one significant digit: a rate with margin below a bound."""
    e = 10.0 ** math.floor(math.log10(x / 2))
    return float(f"{math.floor(x / 2 / e) * e:.1g}")


def lr_clip_fix(d: Divergence | None, info: dict) -> Fix:
    """Lower the learning rate / warm up / clip gradients, with the numbers the history gives: the learning rate
    where the climb began (configured and scheduled), a configured one that is a typo, the clip already in force."""
    opt = info.get("optimizer") if isinstance(info.get("optimizer"), dict) else {}
    lr = finite_float(opt.get("lr", info.get("lr")))
    base = d.base_lr if d and d.base_lr is not None else None
    jump = d.jump if d else lr_jump(info)
    if jump is not None:  # the history shows the rate it trained at: back to that, never a guess at a typo
        j = jump
        lines = [f"{j.sentence}: set it back to {j.before:g}, the rate the history trained at — whatever changed it "
                 f"at step {j.step} (a scheduler's step, an edit of optimizer.param_groups, a resumed optimizer "
                 "state) is the bug",
                 f"for group in optimizer.param_groups: group['lr'] = {j.before:g}",
                 f"and restart from a checkpoint from before step {j.step}: the update made at "
                 f"{j.after:g} already damaged the weights"]
        return Fix(FixKind.LOWER_LR_CLIP_GRADS, "", guidance="\n".join(lines),
                   verification="not replayed: the change is to the training of earlier steps (learning rate, "
                                "clipping); replaying this step cannot test it",
                   reasoning="numbers from the snapshot's history: the rate it trained at before the jump",
                   settings={"lr_bound": j.before})  # an edit of the line that wrote the rate (diagnose/edits/sitefix.py)
    typo = _typo(base if base is not None else lr) if (base or lr) else None
    lines = []
    if typo:
        conf = base if base is not None else lr
        lines.append(f"the configured learning rate is {conf:g}: no optimizer trains at a rate of {TYPO_LR:g} or more — "
                     f"almost surely a typo for {typo} (the exponent's sign); set learning_rate={typo}")
    clip = clip_value(d.healthy_grad_norm) if d and d.healthy_grad_norm else None
    if d and d.clip is not None:
        peak = f" (before clipping, the norm reached {d.grad_norm[1][1]:.3g})" if d.grad_norm else ""
        lines.append(f"gradients were already clipped at max_norm={d.clip:g}{peak}: clipping bounds each step's "
                     f"gradient, not the step the optimizer takes with it — more clipping will not stop this")
    else:
        lines += ["after backward(), clip the gradient norm:",
                  f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={clip if clip else 1.0:g})"]
        if d and clip:
            a, b = d.healthy_steps or (None, None)
            lines.append(f"(the healthy steps {a}–{b} had a gradient norm around {d.healthy_grad_norm:.3g}; "
                         f"{'it reached ' + format(d.grad_norm[1][1], '.3g') if d.grad_norm else 'then it climbed'})")
    if not typo:
        at = d.lr_at_onset if d else None
        bound = sgd_lr_bound(info, d)
        if at is not None:
            sched = f" ({at / base:.0%} of the configured {base:g} on the schedule)" if base and base != at else ""
            tail = ("" if bound else f": keep the peak learning rate below that, e.g. {at / 10:.2g}, or warm up "
                    "more slowly")
            lines.append(f"the climb began at step {d.onset} with the learning rate at {at:.3g}{sched}{tail}")
        if bound is not None:
            top, r, s0, s1, at0 = bound
            lam = (1 + r) / at0
            lines.append(f"at learning rate {at0:g} the gradient norm grew {r:.3g}× in one step ({s0} → {s1}): for SGD "
                         f"that is a direction of curvature at least (1 + {r:.3g}) / {at0:g} = {lam:.3g}, along which "
                         f"SGD is stable only below 2 / {lam:.3g} = {top:.2g}; set the rate below that, e.g. "
                         f"{_below(top):g}:")
            lines.append(f"for group in optimizer.param_groups: group['lr'] = {_below(top):g}  # or lr={_below(top):g} "
                         "where the optimizer is made")
        elif at is None:
            lr_text = f" (now {lr:g}), e.g. to {lr / 10:g}" if lr else ", e.g. 10× lower"
            warm = f" or warm it up over more than the {d.onset} steps it took to diverge" if d else " or warm it up"
            lines.append(f"lower the learning rate{lr_text},{warm}")
    if d:
        lines.append(f"and restart from a checkpoint from before step {d.onset}: the weights are already damaged")
    else:
        lines.append("and restore the last checkpoint with finite, sane weights")
    rate = float(typo) if typo else (_below(bound[0]) if bound is not None else None)
    return Fix(FixKind.LOWER_LR_CLIP_GRADS, "", guidance="\n".join(lines),
               verification="not replayed: the change is to the training of earlier steps (learning rate, "
                            "clipping); replaying this step cannot test it",
               settings={"lr": rate} if rate else None,
               reasoning=("numbers from the snapshot's history" if d else
                          "the weights themselves are the problem: no change at this op makes them sane again"))
