"""`analyze()`: one snapshot in, one `Analysis` out.

It reads as a pipeline — load → rebuild → check leaves → replay → culprit →
diagnose — and returns data. Printing and rendering are the caller's business.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanreplay import __version__, replay, snapshot, stats
from nanreplay import culprit as culprit_mod
from nanreplay.rebuild import Subject, batch_tensors
from nanreplay.replay import Step, frame_json

SCHEMA = "nanreplay.analysis/1"
VERDICTS = ("culprit_found", "nonfinite_input", "nonfinite_parameters", "not_reproduced")


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
        return stats.jsonable(d)


# ------------------------------------------------------------------ pipeline


def analyze(path: str | Path, *, model: str | None = None, loss: str | None = None, device: str | None = None,
            trust: bool = False, verify: bool = True) -> Analysis:
    """Analyze one snapshot file. Raises NanReplayError subclasses for bad input."""
    from nanreplay import diagnose, rebuild
    from nanreplay import verify as verify_mod  # (`verify` is this function's flag)

    t0 = time.perf_counter()
    snap = snapshot.load(path, trust=trust)
    subject = rebuild.subject(snap, model=model, loss=loss, device=device, trust=trust)
    t_load = time.perf_counter()
    result = Analysis(snapshot=str(path), verdict="not_reproduced", model=_model_info(subject),
                      environment=_environment(subject), snapshot_info=_snapshot_info(snap),
                      invocation={"model": model, "loss": loss, "device": device, "trust": trust})
    leaves = check_leaves(subject)
    result.nonfinite_leaves = leaves
    blocking = [r for r in leaves if not r.get("literal")]
    if blocking:
        result.verdict = ("nonfinite_parameters" if any(r["role"] in ("parameter", "buffer") for r in blocking)
                          else "nonfinite_input")
        result.diagnosis = diagnose.for_leaves(result.verdict, blocking, snap)
        result.stats = {"timings": {"load": t_load - t0, "total": time.perf_counter() - t0}}
        return result

    step = replay.run_subject(subject)
    t_replay = time.perf_counter()
    result.step = step
    result.loss = step.loss
    result.gradients = step.grads
    result.warnings += [f"instrumentation error (please report): {e}" for e in step.internal_errors[:5]]
    if step.backward_error:
        result.warnings.append(step.backward_error)

    chain = culprit_mod.chain(step.events, step.failure.event if step.failure else None)
    c = culprit_mod.culprit(step.events, chain)
    if step.failure is not None:
        result.failure = {"what": step.failure.what, "name": step.failure.name, "kind": step.failure.kind,
                          "event": step.failure.event}
    result.chain = [event_json(step, step.events[i]) for i in chain]
    result.anomaly_mode = anomaly_json(step, c)
    if c is not None:
        result.verdict = "culprit_found"
        result.culprit = culprit_json(step, step.events[c])
    elif step.failure is not None:
        result.warnings.append(f"the {step.failure.what} {step.failure.name!r} is non-finite, but no op that "
                               "produced it was seen; nanreplay cannot name a culprit")
    result.activations = activation_rows(step)
    result.gradient_shapes = [{"module": m, "output_shape": o, "grad_shape": g, "mismatch": g is not None and g != o}
                              for m, o, g in step.grad_shapes]
    result.diagnosis = diagnose.diagnose(result, subject, step, c, chain, verify_fixes=verify)
    t_diag = time.perf_counter()
    if c is not None or step.failure is not None:
        result.precision = verify_mod.precision_probe(subject, _step_dtype(subject),
                                                  failure=step.failure.what if step.failure else None)
        note = precision_sentence(result.precision, _step_label(subject))
        if note:
            result.diagnosis["explanation"] += " " + note
            result.diagnosis["precision"] = note
    t_end = time.perf_counter()
    result.stats = {
        "ops_forward": len(step.ops),
        "events": len(step.events),
        "timings": {"load": t_load - t0, "replay": t_replay - t_load, "diagnose": t_diag - t_replay,
                    "precision": t_end - t_diag, "total": t_end - t0},
    }
    return result


NEAR_OVERFLOW = 0.1  # flag activations above this fraction of the dtype's largest value


def activation_rows(step: Step) -> list[dict]:
    rows = []
    for module, mx, dtype in step.activations:
        fmax = torch.finfo(getattr(torch, dtype)).max
        ratio = mx / fmax if isinstance(mx, float) else None
        # Inf output: it overflowed (past "near"). NaN output: its magnitude is unknown, not an overflow.
        rows.append({"module": module, "absmax": mx, "dtype": dtype, "ratio": ratio,
                     "near_overflow": bool(ratio is not None and ratio >= NEAR_OVERFLOW) or mx in ("inf", "-inf")})
    return rows


def _step_dtype(subject: Subject) -> str:
    counts: dict[str, int] = {}
    for p in subject.model.parameters():
        if p.is_floating_point():
            k = stats.dtype_name(p.dtype)
            counts[k] = counts.get(k, 0) + p.numel()
    return max(counts, key=counts.get) if counts else "float32"


def _step_label(subject: Subject) -> str:
    """How the step ran, for sentences: 'float16', or 'autocast float16' under torch.autocast."""
    if subject.autocast:
        ac = subject.autocast
        dtype = ac.get("dtype") or (torch.bfloat16 if ac.get("device_type") == "cpu" else torch.float16)
        return f"autocast {stats.dtype_name(dtype)}"
    return _step_dtype(subject)


def precision_sentence(rows: list[dict], dtype: str) -> str:
    """Tell a precision/range problem from a math domain error (the step failed in `dtype`)."""
    ok = [r["dtype"] for r in rows if r.get("loss_finite") and r.get("grads_finite")]
    bad = [r["dtype"] for r in rows if "error" not in r and not (r.get("loss_finite") and r.get("grads_finite"))]
    if ok:
        also = f" (nor in {', '.join(bad)})" if bad else ""
        return (f"Precision probe: the same step is finite in {', '.join(ok)} but not in {dtype}{also} — "
                "a precision/range problem, not a math domain error.")
    if bad:
        return (f"Precision probe: the step is non-finite in {', '.join(bad)} too — a genuine math domain error, "
                "not a precision problem; a wider dtype will not fix it.")
    return ""


def check_leaves(subject: Subject) -> list[dict]:
    """NaN/Inf already present in the batch, the parameters or the buffers."""
    rows = []
    for name, role, t in batch_tensors(subject):
        nan, inf = stats.leaf_counts(t)
        if nan or inf:
            rows.append({"name": name, "role": role, "nan": nan, "inf": inf, "shape": list(t.shape),
                         "samples": _bad_samples(t)})
    for name, p in subject.model.named_parameters():
        nan, inf = stats.leaf_counts(p)
        if nan or inf:
            rows.append({"name": name, "role": "parameter", "nan": nan, "inf": inf, "shape": list(p.shape)})
    for name, b in subject.model.named_buffers():
        nan, inf = stats.leaf_counts(b)
        if nan or inf:
            # A buffer of ±inf and no NaN is almost always an intentional mask: a constant, not damage.
            rows.append({"name": name, "role": "buffer", "nan": nan, "inf": inf, "shape": list(b.shape),
                         "literal": nan == 0})
    return rows


def _bad_samples(t: torch.Tensor, limit: int = 20) -> list[int]:
    if t.dim() == 0 or not t.is_floating_point():
        return []
    bad = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)
    return bad.nonzero().flatten()[:limit].tolist()


# ------------------------------------------------------------------ JSON pieces


def _module_of(step: Step, ev) -> str | None:
    return step.module_of(ev)


def event_json(step: Step, ev) -> dict:
    return {
        "index": ev.index,
        "phase": ev.phase,
        "kind": ev.kind,
        "op": ev.op,
        "module": _module_of(step, ev),
        "role": ev.role,
        "forward_op": step.forward_op_of(ev),
        "backward_node": ev.node,
        "source": frame_json(step.frame_of(ev)),
        "nan": ev.out["nan"],
        "posinf": ev.out["posinf"],
        "neginf": ev.out["neginf"],
        "numel": ev.out["numel"],
        "parents": list(ev.parents),
    }


def culprit_json(step: Step, ev) -> dict:
    call = step.call_of(ev)
    return {
        "phase": ev.phase,
        "kind": ev.kind,
        "op": ev.op,
        "forward_op": step.forward_op_of(ev),
        "backward_node": ev.node,
        "module": _module_of(step, ev),
        "source": frame_json(step.frame_of(ev)),
        "forward_source": frame_json(step.forward_frame_of(ev)) if ev.frame else None,
        "inputs": ev.inputs or [],
        "output": dict(ev.out),
        "role": ev.role,
        "event": ev.index,
        "call": step.call_names[call] if 0 < call < len(step.call_names) else None,
        "scalars": ev.scalars or [],
    }


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


def _model_info(subject: Subject) -> dict:
    params = list(subject.model.parameters())
    dtypes = sorted({stats.dtype_name(p.dtype) for p in params})
    return {
        "how": subject.how,
        "class": subject.model_class or type(subject.model).__name__,
        "parameters": sum(p.numel() for p in params),
        "dtypes": dtypes,
        "training": subject.model.training,
        "loss": subject.loss_name,
        "autocast": {k: str(v) for k, v in subject.autocast.items()} if subject.autocast else None,
    }


def _environment(subject: Subject) -> dict:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "device": str(subject.device),
    }


def _snapshot_info(snap) -> dict:
    info = {"format": snap.format, "keys": snap.keys, "step": snap.step, "rank": snap.rank,
            "world_size": snap.world_size, "trigger": snap.trigger, "history": snap.history,
            "created": snap.created}
    if snap.format == "native":
        raw, model = snap.raw, snap.raw.get("model") or {}
        info.update(loss_value=raw.get("loss_value"), grad_norm=raw.get("grad_norm"),
                    environment=raw.get("environment"), export_error=model.get("export_error"),
                    factory=model.get("factory"), model_class=model.get("class"),
                    loss_spec={k: v for k, v in (raw.get("loss_spec") or {}).items() if k != "kwargs"},
                    autocast=raw.get("autocast"), grad_scale=raw.get("grad_scale"),
                    nanreplay_version=raw.get("nanreplay_version"))
    return info
