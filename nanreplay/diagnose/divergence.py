"""Reading the snapshot's history: did training diverge, and from which step; what to clip at.

`snapshot_info.history` holds {step, loss, grad_norm} for the steps before the snapshot. A run
diverges when, after some healthy steps, the loss or the gradient norm climbs by orders of
magnitude and stays up. The healthy steps' gradient norm is the number to clip at; the step the
climb started at says how long a warmup (or how early a checkpoint) is needed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from nanreplay.diagnose.model import Fix
from nanreplay.diagnose.plausible import history_rows
from nanreplay.diagnose.site import finite_float
from nanreplay.enums import FixKind

LOSS_CLIMB = 10.0  # the last loss at least this many times the healthy minimum ...
NORM_CLIMB = 100.0  # ... or the last gradient norm at least this many times the healthy median


@dataclass
class Divergence:
    onset: int  # the first step of the climb
    loss: tuple[tuple[int, float], tuple[int, float]] | None  # (step, loss) healthy minimum, last
    grad_norm: tuple[tuple[int, float], tuple[int, float]] | None  # (step, norm) healthy median, last
    healthy_grad_norm: float | None  # median gradient norm of the steps before the climb
    healthy_steps: tuple[int, int] | None

    @property
    def story(self) -> str:
        parts = []
        if self.loss:
            (s0, a), (s1, b) = self.loss
            parts.append(f"the loss climbed from {a:.3g} (step {s0}) to {b:.3g} (step {s1})")
        if self.grad_norm:
            (s0, a), (s1, b) = self.grad_norm
            parts.append(f"the gradient norm from {a:.3g} to {b:.3g} (step {s1})")
        return " and ".join(parts) + f", starting at step {self.onset}"

    def to_json(self) -> dict:
        return {"onset_step": self.onset,
                "loss": [{"step": s, "loss": v} for s, v in self.loss] if self.loss else None,
                "grad_norm": [{"step": s, "grad_norm": v} for s, v in self.grad_norm] if self.grad_norm else None,
                "healthy_grad_norm": self.healthy_grad_norm,
                "healthy_steps": list(self.healthy_steps) if self.healthy_steps else None}


def _series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r.get("step", i), v) for i, r in enumerate(rows) if (v := finite_float(r.get(key))) is not None]


def divergence(info: dict) -> Divergence | None:
    """The climb in the snapshot's history, or None when the history is short or healthy."""
    rows = history_rows(info)
    if len(rows) < 3:
        return None
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
    loss = grad = None
    if healthy_l and losses and losses[-1][0] >= onset:
        low = min(healthy_l, key=lambda sv: sv[1])
        if low[1] > 0 and losses[-1][1] >= LOSS_CLIMB * low[1] and losses[-1][1] >= 0.5 * max(v for _, v in losses):
            loss = (low, losses[-1])
    med = statistics.median(v for _, v in healthy_g) if healthy_g else None
    if med and norms and norms[-1][0] >= onset and norms[-1][1] >= NORM_CLIMB * med:
        grad = ((healthy_g[0][0], med), norms[-1])
    if loss is None and grad is None:
        return None
    steps = [s for s, _ in healthy_l + healthy_g]
    return Divergence(onset, loss, grad, med, (min(steps), max(steps)) if steps else None)


def clip_value(x: float) -> float:
    """A clip threshold from a gradient norm: two significant digits."""
    return float(f"{x:.2g}")


def lr_clip_fix(d: Divergence | None, info: dict) -> Fix:
    """Lower the learning rate / warm up / clip gradients, with the numbers the history gives."""
    opt = info.get("optimizer") if isinstance(info.get("optimizer"), dict) else {}
    lr = finite_float(opt.get("lr", info.get("lr")))
    clip = clip_value(d.healthy_grad_norm) if d and d.healthy_grad_norm else None
    lines = ["after backward(), clip the gradient norm:",
             f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={clip if clip else 1.0:g})"]
    if d and clip:
        a, b = d.healthy_steps or (None, None)
        lines.append(f"(the healthy steps {a}–{b} had a gradient norm around {d.healthy_grad_norm:.3g}; "
                     f"{'the last one reached ' + format(d.grad_norm[1][1], '.3g') if d.grad_norm else 'then it climbed'})")
    lr_text = f" (now {lr:g}), e.g. to {lr / 10:g}" if lr else ", e.g. 10× lower"
    warm = f" or warm it up over more than the {d.onset} steps it took to diverge" if d else " or warm it up"
    lines.append(f"lower the learning rate{lr_text},{warm}")
    if d:
        lines.append(f"and restart from a checkpoint from before step {d.onset}: the weights are already damaged")
    else:
        lines.append("and restore the last checkpoint with finite, sane weights")
    return Fix(FixKind.LOWER_LR_CLIP_GRADS, "", guidance="\n".join(lines),
               verification="not replayed: the change is to the training of earlier steps (learning rate, "
                            "clipping); replaying this step cannot test it",
               reasoning=("numbers from the snapshot's history" if d else
                          "the weights themselves are the problem: no change at this op makes them sane again"))
