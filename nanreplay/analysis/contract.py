"""The pieces of the JSON contract built from a replay (see DESIGN's CLI/JSON contract); `Analysis` is in result.py.

Fields are only ever added, never renamed; `tests/analysis/test_contract.py` pins them.
"""

from __future__ import annotations

import torch

from nanreplay import seeded, stats
from nanreplay.analysis import saved
from nanreplay.analysis.arguments import name_inputs
from nanreplay.analysis.result import SCHEMA, Analysis, precision_sentence  # noqa: F401 - re-exported
from nanreplay.replay import Step, frame_json
from nanreplay.replay.probe import forward_op_inputs

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
    found = saved.forward_inputs(ev, str(rec.op))  # the culprit's own argument, where its formula takes x as it was
    if found is None:
        kept = seeded.op_inputs(subject, rec.node, str(rec.op))  # from the segment's start, where it was kept
        found = [stats.tensor_stats(t) for t in kept] if kept is not None else \
            forward_op_inputs(subject, ev.fwd, str(rec.op))
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
