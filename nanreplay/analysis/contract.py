"""The analysis as data: `Analysis` and the pieces of the JSON contract (see DESIGN's CLI/JSON contract).

Fields are only ever added, never renamed; `tests/analysis/test_contract.py` pins them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanreplay import __version__, stats
from nanreplay.analysis.arguments import name_inputs
from nanreplay.replay import Step, frame_json
from nanreplay.replay.probe import forward_op_inputs

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
    step: Step | None = field(default=None, repr=False)  # the raw replay, for renderers; not in JSON
    snapshot_info: dict = field(default_factory=dict)
    precision: list[dict] = field(default_factory=list)  # the step replayed in other dtypes
    activations: list[dict] = field(default_factory=list)  # max |output| per module call, forward order
    gradient_shapes: list[dict] = field(default_factory=list)
    invocation: dict = field(default_factory=dict)  # model/loss/device/trust exactly as the caller gave them
    update: dict | None = None  # update snapshots only: the replayed optimizer step (analysis/update.py)
    distributed: dict | None = None  # sharded snapshots: the ranks together (analysis/ranks.py merge())

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
        return stats.jsonable(d)

    @classmethod
    def from_json(cls, d: dict) -> Analysis:
        """An analysis read back from its JSON (the N-rank analysis returns it so); `step` stays None."""
        names = {f for f in cls.__dataclass_fields__ if f != "step"}
        return cls(**{k: v for k, v in d.items() if k in names})


NEAR_OVERFLOW = 0.1  # flag activations above this fraction of the dtype's largest value


def activation_rows(step: Step) -> list[dict]:
    rows = []
    for module, mx, dtype in step.activations:
        fmax = torch.finfo(getattr(torch, dtype)).max
        # A non-finite max |x| gives a non-finite ratio, written like every non-finite number ("nan", "inf").
        ratio = mx / fmax if isinstance(mx, float) else mx
        # Inf output: it overflowed (past "near"). NaN output: its magnitude is unknown, not an overflow.
        rows.append({"module": module, "absmax": mx, "dtype": dtype, "ratio": ratio,
                     "near_overflow": (isinstance(ratio, float) and ratio >= NEAR_OVERFLOW) or mx in ("inf", "-inf")})
    return rows


def event_json(step: Step, ev) -> dict:
    return {
        "index": ev.index,
        "phase": ev.phase,
        "kind": ev.kind,
        "op": ev.op,
        "module": step.module_of(ev),
        "role": ev.role,
        "forward_op": step.forward_op_of(ev),
        "backward_node": ev.node,
        "source": frame_json(step.frame_of(ev), context=ev.role != "propagation"),
        "nan": ev.out["nan"],
        "posinf": ev.out["posinf"],
        "neginf": ev.out["neginf"],
        "numel": ev.out["numel"],
        "parents": list(ev.parents),
    }


def culprit_json(step: Step, ev) -> dict:
    """The `culprit` object. Each input carries `arg` (its schema name) and `role` (what it is, where known);
    `forward_inputs` is filled in for backward culprits by `forward_inputs_json` (a second look, after replay)."""
    call = step.call_of(ev)
    call_name = step.call_names[call] if 0 < call < len(step.call_names) else None
    user_call = step.user_call(call)
    return {
        "phase": ev.phase,
        "kind": ev.kind,
        "op": ev.op,
        "forward_op": step.forward_op_of(ev),
        "backward_node": ev.node,
        "module": step.module_of(ev),
        "source": frame_json(step.frame_of(ev)),
        "forward_source": frame_json(step.forward_frame_of(ev)) if ev.frame else None,
        "inputs": name_inputs(ev.op, ev.inputs or [], backward_node=ev.node, call=user_call or call_name),
        "output": dict(ev.out),
        "role": ev.role,
        "event": ev.index,
        "call": call_name,
        "user_call": user_call or call_name,
        "scalars": ev.scalars or [],
        "forward_inputs": None,
    }


def forward_inputs_json(subject, step: Step, ev) -> list[dict] | None:
    """For a backward culprit: the inputs of the forward op whose gradient it computed (`x` of `sqrt(x)`), named."""
    if ev.phase != "backward" or ev.fwd is None:
        return None
    rec = step.ops[ev.fwd]
    found = forward_op_inputs(subject, ev.fwd, str(rec.op))
    if found is None:
        return None
    call_name = step.call_names[rec.call] if 0 < rec.call < len(step.call_names) else None
    return stats.jsonable(name_inputs(str(rec.op), found, call=call_name))


def anomaly_json(step: Step, c: int | None) -> dict:
    a = step.anomaly
    if a is None:
        return {"raises": None, "node": None, "agrees_with_culprit": None}
    agrees = None
    if a.raises and c is not None:
        ev = step.events[c]
        if ev.phase == "backward":
            agrees = ev.node_seq == a.node_seq
        else:  # a forward culprit: does anomaly mode stop at the node that op created?
            agrees = step.op_by_seq.get(a.node_seq) == ev.fwd
    elif c is not None:
        agrees = False
    out = {"raises": a.raises, "node": a.node, "agrees_with_culprit": agrees, "message": a.message}
    if a.raises:
        fwd = step.op_by_seq.get(a.node_seq)
        if fwd is not None:
            rec = step.ops[fwd]
            out["forward_op"] = str(rec.op)
            out["module"] = rec.module
            out["source"] = frame_json(rec.frame)
    return out


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
