"""`analyze()`: one snapshot in, one `Analysis` out — the only orchestrator.

It reads as a pipeline — load → rebuild → check leaves → replay → culprit →
diagnose — and returns data. Printing and rendering are the caller's business.
"""

from __future__ import annotations

import os
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from nanreplay import culprit as culprit_mod
from nanreplay import diagnose, formats, replay, stats, torch_internals
from nanreplay import verify as verify_mod
from nanreplay.analysis import distributed, launch
from nanreplay.analysis import update as update_mod
from nanreplay.analysis.contract import (
    Analysis,
    activation_rows,
    anomaly_json,
    culprit_json,
    event_json,
    forward_inputs_json,
    precision_sentence,
)
from nanreplay.diagnose import broadcast
from nanreplay.diagnose.edits import sitefix
from nanreplay.diagnose.plausible import history_rows
from nanreplay.diagnose.site import finite_float
from nanreplay.diagnose.update import diagnose_update
from nanreplay.differential import compiler as compiler_replay
from nanreplay.differential import kernel as kernel_diff
from nanreplay.differential import machine
from nanreplay.enums import Verdict
from nanreplay.errors import LimitError, NanReplayError, UsageError, first_line
from nanreplay.limits import format_size, release_memory
from nanreplay.replay.records import Step
from nanreplay.replay.subject import Subject, batch_tensors
from nanreplay.replay.update import run_update

Progress = Callable[[str, Analysis], None]  # (stage, the analysis so far): see analyze()

# ------------------------------------------------------------------ pipeline


def analyze(path: str | Path, *, model: str | None = None, loss: str | None = None, device: str | None = None,
            trust: bool = False, verify: bool = True, max_memory: int | None = None,
            source: list[str] | tuple[str, ...] | None = None, only_if_needed: bool = False,
            nproc: int = 1, progress: Progress | None = None) -> Analysis:
    """Analyze one snapshot file (or sharded snapshot folder). Raises NanReplayError subclasses for bad input.

    `nproc` > 1: a sharded snapshot's ranks replay on that many local processes (analysis/launch.py).

    `source`: folders whose .py files may be read to show and rewrite lines the snapshot recorded
    (default: none — a snapshot's lines come from the snapshot; a file is used only where its line matches
    the recorded code).
    `max_memory` (bytes, None: no limit): a snapshot, or a replay whose peak memory is bounded from
    its step program, that would need more is refused (LimitError).
    With `only_if_needed` (triage over a mixed folder), `model` and `loss` apply only to a
    snapshot that cannot be rebuilt without them (a plain state-dict snapshot): one that
    carries its own step is replayed as it is.
    `progress(stage, analysis)` is told as each pass finishes, with the analysis so far: "loaded", "culprit"
    (the replay has named the culprit, or found none: verdict, culprit, chain and failure are final), "diagnosis"
    (cause, fix and its verification), "precision". The returned analysis is the complete one.
    """
    if nproc > 1:
        return _analyze_nproc(path, nproc, model=model, loss=loss, device=device, max_memory=max_memory, source=source)
    roots = tuple(os.path.abspath(d) for d in source) if source is not None else ()
    token = replay.SOURCE_ROOTS.set(roots)
    try:
        with warnings.catch_warnings():
            # torch's UserWarnings about the user's step (a loss whose target broadcasts, ...) were said in training;
            # each replay would repeat them, attributed to nanreplay's own lines (replay/recorder.py, subject.py)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"nanreplay\.")
            return _analyze(path, model=model, loss=loss, device=device, trust=trust, verify=verify,
                            max_memory=max_memory, source=source, only_if_needed=only_if_needed, progress=progress)
    finally:
        replay.SOURCE_ROOTS.reset(token)


def _analyze_nproc(path, nproc: int, *, model, loss, device, max_memory, source) -> Analysis:
    if not Path(path).is_dir():
        raise UsageError(f"{path}: --nproc replays the ranks of a sharded snapshot folder; this is a single file")
    if model is not None or loss is not None:
        raise UsageError(f"{path}: a sharded snapshot replays the step programs its ranks recorded; "
                         "--model and --loss do not apply to it")
    snap = formats.load(path, max_memory=max_memory)  # checked here first: a bad folder is one line, no launch
    world = snap.world_size if snap.format == "sharded" else None
    if world != nproc:
        raise UsageError(f"{path}: the snapshot holds the step of {world} ranks; replay them with --nproc {world}, "
                         "or on one process (without --nproc)")
    d = launch.run_nproc(str(path), nproc, device=device, max_memory=max_memory,
                         source=list(source) if source is not None else None)
    result = Analysis.from_json(d)
    result.snapshot = str(path)
    return result


def _analyze(path, *, model, loss, device, trust, verify, max_memory, source, only_if_needed,
             progress: Progress | None = None) -> Analysis:
    t0 = time.perf_counter()
    snap = formats.load(path, trust=trust, max_memory=max_memory)
    invocation = {"model": model, "loss": loss, "device": device, "trust": trust,
                  "source": list(source) if source is not None else None}
    if update_mod.is_update(snap):
        done = _analyze_update(path, snap, model=model, loss=loss, device=device, trust=trust, verify=verify,
                               max_memory=max_memory, invocation=invocation, t0=t0)
        if done is not None:
            return done
    if snap.format == "sharded":  # all ranks of one step: replay each, merge (analysis/distributed.py)
        if model is not None or loss is not None:
            formats.rebuild(snap, model=model, loss=loss, device=device, trust=trust)  # says why not, one line
        ranks = distributed.replay_ranks(snap, device=device, max_memory=max_memory)
        r = ranks.chosen(snap)
        snap.rank, snap.history = r, ranks.history(snap, r)
        result = analyze_subject(snap, ranks.subjects[r], path=path, invocation=invocation, verify=verify, t0=t0,
                                 t_load=ranks.t_loaded, step=ranks.steps.get(r))
        distributed.finish(result, snap, ranks, r, replay="single_process", nproc=1)
        return result
    limits = {"device": device, "trust": trust, "max_memory": max_memory}
    if only_if_needed and (model or loss):
        try:
            subject = formats.rebuild(snap, model=None, loss=None, **limits)
            model = loss = None
            invocation.update(model=None, loss=None)
        except NanReplayError:
            subject = formats.rebuild(snap, model=model, loss=loss, **limits)
    else:
        subject = formats.rebuild(snap, model=model, loss=loss, **limits)
    return analyze_subject(snap, subject, path=path, invocation=invocation, verify=verify, t0=t0,
                           t_load=time.perf_counter(), progress=progress)


def analyze_subject(snap, subject: Subject, *, path, invocation: dict, verify: bool, t0: float, t_load: float,
                    step: Step | None = None, probe: bool = True, progress: Progress | None = None) -> Analysis:
    """The analysis of one rebuilt step: leaves, replay (unless `step` is that replay already), culprit,
    diagnosis, fix verification (`verify`) and the precision probe (`probe`); `progress`: see `analyze`."""
    tell = progress or (lambda stage, analysis: None)
    result = Analysis(snapshot=str(path), verdict=Verdict.NOT_REPRODUCED, model=_model_info(subject),
                      environment=_environment(subject.device), snapshot_info=_snapshot_info(snap),
                      invocation=invocation)
    program = getattr(subject.model, "program", None) if subject.program else None
    result.broadcast = broadcast.find(program) if program is not None else []  # a loss that broadcast silently
    result.warnings += [b["message"] for b in result.broadcast]
    leaves = check_leaves(subject)
    result.nonfinite_leaves = leaves
    blocking = [r for r in leaves if not r.get("literal")]
    if blocking:
        result.verdict = (Verdict.NONFINITE_PARAMETERS if any(r["role"] in ("parameter", "buffer") for r in blocking)
                          else Verdict.NONFINITE_INPUT)
        result.diagnosis = diagnose.for_leaves(result.verdict, blocking, snap)
        result.stats = {"timings": {"load": t_load - t0, "total": time.perf_counter() - t0}}
        return result

    snap.drop_optimizer_state()  # read only by the leaves' diagnosis above and by update analyses
    tell("loaded", result)
    if step is None:
        keep = getattr(subject.model, "keep_boundaries", None) if subject.program and probe else None
        if keep is not None:
            keep()  # the values at each segment's start, for the precision probe (nanreplay/seeded.py)
        step = replay.run_subject(subject)
        subject.model.zero_grad(set_to_none=True)  # the gradient walk is in `step`; the tensors are not needed
    release_memory()  # each pass starts from what the analysis holds, not from the last pass's peak
    t_replay = time.perf_counter()
    result.step = step
    # the replay backpropagates the scaled loss, as a GradScaler run did; people want the loss itself
    result.loss = step.loss / subject.loss_scale if subject.loss_scale and step.loss is not None else step.loss
    result.gradients = step.grads
    result.warnings += [f"instrumentation error (please report): {e}" for e in step.internal_errors[:5]]
    if step.backward_error:
        result.warnings.append(step.backward_error)

    chain = culprit_mod.chain(step.events, step.failure.event if step.failure else None)
    c = culprit_mod.culprit(step.events, chain)
    drop = getattr(subject.model, "drop_kept", None) if subject.program else None
    node = step.ops[step.events[c].fwd].node if c is not None and step.events[c].fwd is not None else None
    if drop is not None and node is None:
        drop()
    elif drop is not None:  # only what the culprit's probe reads stays (formats/boundaries.py)
        subject.model.trim_kept(node, backward=step.events[c].phase == "backward")
    if step.failure is not None:
        result.failure = {"what": step.failure.what, "name": step.failure.name, "kind": step.failure.kind,
                          "event": step.failure.event}
    result.chain = [event_json(step, step.events[i]) for i in chain]
    result.anomaly_mode = anomaly_json(step, c)
    if c is not None:
        result.verdict = Verdict.CULPRIT_FOUND
        result.culprit = culprit_json(step, step.events[c])
    elif step.failure is not None:
        result.warnings.append(f"the {step.failure.what} {step.failure.name!r} is non-finite, but no op that "
                               "produced it was seen; nanreplay cannot name a culprit")
    result.activations = activation_rows(step)
    result.gradient_shapes = [{"module": m, "output_shape": o, "grad_shape": g, "mismatch": g is not None and g != o}
                              for m, o, g in step.grad_shapes]
    tell("culprit", result)
    machine.attach(result, snap, subject.device, step, culprit_found=c is not None)  # reads the guard's re-run record
    result.diagnosis = diagnose.diagnose(result, subject, step, c, chain, verify_fixes=verify)
    sitefix.attach(result.diagnosis, getattr(snap, "raw", None) or {}, result.warnings)  # an lr, eps: its line
    flow_found = result.diagnosis.pop("gradient_flow", None)  # a dead-gradient snapshot (diagnose/flow.py)
    if flow_found is not None:
        result.gradient_flow = flow_found
        result.verdict = flow_found.get("verdict") or result.verdict
    compiler_replay.attach(result, subject, verify=verify)  # a compiled run that replays finite: replay it compiled
    result.warnings += [f"internal error (please report): {e}" for e in result.diagnosis.get("internal_errors", [])]
    if c is not None:
        result.culprit["forward_inputs"] = forward_inputs_json(subject, step, step.events[c])
    kernel_diff.attach(result, subject, step, c, verify=verify)  # a fused kernel's culprit only: the kernel vs its reference
    release_memory()
    t_diag = time.perf_counter()
    tell("diagnosis", result)
    if probe and (c is not None or step.failure is not None):
        cev = step.events[c] if c is not None else None
        where = verify_mod.Culprit.of(cev.phase, cev.fwd, str(cev.op), [str(o.op) for o in step.ops],
                                      step.ops[cev.fwd].node) \
            if cev is not None and cev.fwd is not None and cev.phase in ("forward", "backward") else None
        result.precision = verify_mod.precision_probe(subject, _step_dtype(subject), culprit=where,
                                                      failure=step.failure.what if step.failure else None)
        hist = _history_loss(result)
        for r in result.precision if hist else []:
            if r.get("loss_finite") and isinstance(r.get("loss"), (int, float)):
                r["beyond_history"] = abs(r["loss"]) > 10 * hist  # plausible.LOSS_FACTOR × the run's largest loss
        note = precision_sentence(result.precision, _step_label(subject))
        if note:
            result.diagnosis["explanation"] += " " + note
            result.diagnosis["precision"] = note
        tell("precision", result)
    if drop is not None:
        drop()
    t_end = time.perf_counter()
    result.stats = {
        "ops_forward": len(step.ops),
        "events": len(step.events),
        "timings": {"load": t_load - t0, "replay": t_replay - t_load, "diagnose": t_diag - t_replay,
                    "precision": t_end - t_diag, "total": t_end - t0},
    }
    return result


def _analyze_update(path, snap, *, model, loss, device, trust, verify, max_memory, invocation, t0) -> Analysis | None:
    """An update snapshot: replay optimizer.step() from the weights before it, name the op inside the update that
    broke the weights, diagnose, verify fixes by replaying the update. None: analyze the step instead (the
    gradients the update used were already non-finite: the step is where they broke)."""
    us = update_mod.subject(snap, device)
    try:
        subject, why = formats.rebuild(snap, model=model, loss=loss, device=device, trust=trust,
                                       max_memory=max_memory), None
    except NanReplayError as e:
        subject, why = None, first_line(e, 300)
    leaves = update_mod.leaves(us)
    if any(r["role"] == "gradient" for r in leaves) and subject is not None:
        return None
    t_load = time.perf_counter()
    result = Analysis(snapshot=str(path), verdict=Verdict.NOT_REPRODUCED, invocation=invocation,
                      model=_model_info(subject) if subject is not None else update_mod.model_info(snap, us, why),
                      environment=_environment(us.device), snapshot_info=_snapshot_info(snap))
    result.nonfinite_leaves = leaves
    result.loss = snap.raw.get("loss_value")
    result.anomaly_mode = dict(update_mod.NO_ANOMALY)
    if us.pre_step == "post_step":  # nothing to replay from: what the weights and the state say
        result.warnings.append(f"the snapshot holds the weights after the {us.cls} update, not before it (nanreplay "
                               "recovers them only for SGD, Adam and AdamW): the update is not replayed; capture with "
                               "NanGuard(..., keep_pre_step=True) to replay it")
        rows = [{"name": n, "role": "parameter", "nan": c["nan"], "inf": c["posinf"] + c["neginf"]}
                for n, c in us.nonfinite_after.items()]
        result.verdict = Verdict.NONFINITE_PARAMETERS
        # the weights the snapshot holds are these same post-step weights: each parameter once (leaves' has its shape)
        listed = {(r["name"], r["role"]) for r in leaves}
        result.nonfinite_leaves = [r for r in rows if (r["name"], r["role"]) not in listed] + leaves
        result.diagnosis = diagnose.for_leaves(result.verdict, rows, snap)
        result.stats = {"timings": {"load": t_load - t0, "total": time.perf_counter() - t0}}
        return result
    bound = update_mod.memory_bound(us)
    if max_memory is not None and bound > max_memory:
        raise LimitError(f"{path}: replaying this update needs about {format_size(bound)} (its weights, gradients and "
                         f"state, three times over), more than --max-memory {format_size(max_memory)}; raise the "
                         "limit if this machine has the memory")
    upd = run_update(us)
    t_replay = time.perf_counter()
    step = upd.step
    result.step = step
    result.gradients = step.grads
    result.warnings += [f"instrumentation error (please report): {e}" for e in step.internal_errors[:5]]
    chain = culprit_mod.chain(step.events, step.failure.event if step.failure else None)
    c = culprit_mod.culprit(step.events, chain)
    drop = getattr(subject.model, "drop_kept", None) if subject.program else None
    node = step.ops[step.events[c].fwd].node if c is not None and step.events[c].fwd is not None else None
    if drop is not None and node is None:
        drop()
    elif drop is not None:  # only what the culprit's probe reads stays (formats/boundaries.py)
        subject.model.trim_kept(node, backward=step.events[c].phase == "backward")
    if step.failure is not None:
        result.failure = {"what": step.failure.what, "name": step.failure.name, "kind": step.failure.kind,
                          "event": step.failure.event}
    result.chain = update_mod.chain_json(upd, chain)
    if c is not None:
        result.verdict = Verdict.CULPRIT_FOUND
        result.culprit = update_mod.culprit(us, upd, c)
    result.diagnosis = diagnose_update(us, upd, c, chain, verify_fixes=verify)
    sitefix.attach(result.diagnosis, snap.raw, result.warnings)  # the optimizer's / scheduler's line, edited
    t_diag = time.perf_counter()
    result.update = update_mod.update_json(us, upd, update_mod.forward_check(subject, us, snap, why))
    if not result.update["reproduced"] and c is not None:
        result.warnings.append("the replayed update breaks other entries than training saw (compare "
                               "update.nonfinite_after): the weights before it were recovered, not copied")
    t_end = time.perf_counter()
    result.stats = {"ops_optimizer": len(step.ops), "events": len(step.events),
                    "timings": {"load": t_load - t0, "replay": t_replay - t_load, "diagnose": t_diag - t_replay,
                                "step_program": t_end - t_diag, "total": t_end - t0}}
    return result


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


def check_leaves(subject: Subject) -> list[dict]:
    """NaN/Inf already present in the batch, the parameters or the buffers."""
    rows = []
    for name, role, t in batch_tensors(subject):
        row = stats.leaf_row(name, role, t)
        if row:
            # -inf and nothing else non-finite: a mask's values (replayed; the chain says if they broke the step)
            rows.append({**row, "samples": _bad_samples(t), **({"literal": True} if stats.mask_values(t) else {})})
    for name, p in subject.model.named_parameters():
        row = stats.leaf_row(name, "parameter", p)
        if row:
            rows.append(row)
    for name, b in subject.model.named_buffers():
        row = stats.leaf_row(name, "buffer", b)
        if row:
            # A buffer of ±inf and no NaN is almost always an intentional mask: a constant, not damage.
            rows.append({**row, "literal": row["nan"] == 0})
    return rows


def _bad_samples(t: torch.Tensor, limit: int = 20) -> list[int]:
    """The samples (dim 0) holding NaN/Inf; in a tensor that also holds a mask's -inf, those with NaN or +inf."""
    if t.dim() == 0 or not t.is_floating_point():
        return []
    rows = t.reshape(t.shape[0], -1)
    bad = (torch.isnan(rows) | torch.isposinf(rows)).any(dim=1)
    if not bool(bad.any()):
        bad = ~torch.isfinite(rows).all(dim=1)
    return bad.nonzero().flatten()[:limit].tolist()


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


def _environment(device: torch.device) -> dict:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "device": str(device),
        "torch_internals": torch_internals.probe(),  # which private torch APIs work here (and what degrades)
    }


def _snapshot_info(snap) -> dict:
    info = {"format": snap.format, "keys": snap.keys, "step": snap.step, "rank": snap.rank,
            "world_size": snap.world_size, "trigger": snap.trigger, "history": snap.history,
            "created": snap.created}
    info.update(formats.describe(snap))
    return info


def _history_loss(result) -> float | None:
    """The largest |loss| of the run's recent steps before this one, where the snapshot recorded them."""
    info = getattr(result, "snapshot_info", None) or {}
    losses = [abs(v) for r in history_rows(info) if (v := finite_float(r.get("loss"))) is not None]
    return max(losses) if losses else None
