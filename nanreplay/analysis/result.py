"""The analysis as data: `Analysis`, its JSON (the CLI/JSON contract) — light, no torch.

The renderers (report, Markdown, terminal) read an `Analysis` only, so a process that renders an
analysis read back from JSON (the confined child's parent, confine/) never imports torch. The pieces
that build the JSON from a replay are in contract.py. Fields are only ever added, never renamed;
`tests/analysis/test_contract.py` pins them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanreplay import __version__

if TYPE_CHECKING:
    from nanreplay.replay import Step

SCHEMA = "nanreplay.analysis/1"


@dataclass
class Analysis:
    snapshot: str
    verdict: str
    culprit: dict | None = None
    chain: list[dict] = field(default_factory=list)
    nonfinite_leaves: list[dict] = field(default_factory=list)
    anomaly_mode: dict = field(default_factory=lambda: {"raises": None, "node": None, "agrees_with_culprit": None})
    diagnosis: dict = field(default_factory=dict)
    failure: dict | None = None
    loss: float | None = None
    gradients: list[dict] = field(default_factory=list)
    model: dict = field(default_factory=dict)  # how it was rebuilt
    environment: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # ops, events, timings
    warnings: list[str] = field(default_factory=list)
    # the raw replay, for in-process callers; not in JSON (renderers read none of it)
    step: Step | None = field(default=None, repr=False)
    snapshot_info: dict = field(default_factory=dict)
    precision: list[dict] = field(default_factory=list)  # the step replayed in other dtypes
    activations: list[dict] = field(default_factory=list)  # max |output| per module call, forward order
    gradient_shapes: list[dict] = field(default_factory=list)
    invocation: dict = field(default_factory=dict)  # model/loss/device/trust exactly as the caller gave them
    update: dict | None = None  # update snapshots only: the replayed optimizer step (analysis/update.py)
    distributed: dict | None = None  # sharded snapshots: the ranks together (analysis/ranks.py merge())
    differential: dict | None = None  # replays that test a hypothesis (differential/): {"compiler"|"kernel"|"machine": {...}}
    broadcast: list[dict] = field(default_factory=list)  # loss ops whose inputs broadcast silently (diagnose/broadcast.py)
    gradient_flow: dict | None = None  # dead/cut gradients (trigger no_gradient / gradient_died): diagnose/flow.py

    def to_json(self) -> dict:
        d = {
            "schema": SCHEMA,
            "snapshot": self.snapshot,
            "verdict": self.verdict,
            "culprit": self.culprit,
            "chain": self.chain,
            "nonfinite_leaves": self.nonfinite_leaves,
            "anomaly_mode": self.anomaly_mode,
            "diagnosis": self.diagnosis,
            "failure": self.failure,
            "loss": self.loss,
            "gradients": self.gradients,
            "model": self.model,
            "snapshot_info": self.snapshot_info,
            "environment": self.environment,
            "stats": self.stats,
            "precision": self.precision,
            "activations": self.activations,
            "near_overflow": [a for a in self.activations if a.get("near_overflow")],
            "gradient_shapes": self.gradient_shapes,
            "invocation": self.invocation,
            "warnings": self.warnings,
            "nanreplay_version": __version__,
        }
        if self.update is not None:
            d["update"] = self.update
        if self.distributed is not None:  # sharded snapshots only (absent otherwise: the goldens stay as they are)
            d["distributed"] = self.distributed
        if self.broadcast:  # only where a loss broadcast (absent otherwise: the goldens stay as they are)
            d["broadcast"] = self.broadcast
        if self.gradient_flow is not None:  # dead-gradient snapshots only (absent otherwise)
            d["gradient_flow"] = self.gradient_flow
        if self.differential:  # only where a differential replay's question arose (absent otherwise)
            d["differential"] = self.differential
        from nanreplay import stats  # torch: only the side that computed the analysis serialises it

        return stats.jsonable(d)

    @classmethod
    def from_json(cls, d: dict) -> Analysis:
        """An analysis read back from its JSON (the N-rank analysis returns it so); `step` stays None."""
        names = {f for f in cls.__dataclass_fields__ if f != "step"}
        return cls(**{k: v for k, v in d.items() if k in names})


def precision_sentence(rows: list[dict], ran: str) -> str:
    """What the precision probe's rows say, in one sentence written from those rows (it cannot contradict them):
    a precision/range problem (finite in a wider dtype) or a math domain error (non-finite in every dtype) — or a
    magnitude problem, where every finite row's loss is `beyond_history` (far beyond the run's recent losses:
    broken in every dtype, e.g. weights that grew)."""
    rows = [r for r in rows or [] if "error" not in r]
    ok = [str(r.get("dtype")) for r in rows if r.get("loss_finite") and r.get("grads_finite")]
    bad = [str(r.get("dtype")) for r in rows if not (r.get("loss_finite") and r.get("grads_finite"))]
    fine = [r for r in rows if r.get("loss_finite") and r.get("grads_finite")]
    if fine and all(r.get("beyond_history") for r in fine):
        low = min(abs(r["loss"]) for r in fine)
        return (f"The step is finite when replayed in {', '.join(ok)}, but its loss there ({low:.4g} and up) is far "
                "beyond the run's recent losses: broken in every dtype — a magnitude problem, not a precision one; "
                "a wider dtype will not fix it.")
    if ok:
        also = f" (and not in {', '.join(bad)} either)" if bad else ""
        return (f"The step is finite when replayed in {', '.join(ok)}, but not in {ran} as it ran{also}: a "
                "precision/range problem, not a math domain error.")
    if bad:
        return (f"The step is non-finite in {', '.join(bad)} too: a math domain error, not a precision problem; a "
                "wider dtype will not fix it.")
    return ""
