"""One instrumented replay of a training step: forward, loss and backward.

`run()` installs the Recorder's modes and hooks, runs the step, removes them again
(even when the replay raises) and returns a `Step`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from nanreplay import stats
from nanreplay import torch_internals as ti
from nanreplay.enums import Kind
from nanreplay.errors import NanReplayError, ReplayError, raised
from nanreplay.replay.frames import frame_json
from nanreplay.replay.recorder import Anomaly, Recorder, StopReplay, _CallMode, _OpMode, _storage_key, call_name
from nanreplay.replay.records import Failure, Step


def run(model: torch.nn.Module, forward: Callable[[], Any], loss: Callable[[Any], torch.Tensor], *,
        names: dict[int, str], prepare: Callable[[], None] | None = None, autocast: dict | None = None,
        site: Callable | None = None, intercepts: dict[int, Callable] | None = None,
        loss_module: str = "<loss>", backward_after_bad_loss: bool = True, stop_at_failure: bool = False,
        leaf_names: list[tuple[torch.Tensor, tuple[str, str]]] | None = None, lazy_counts: bool = True) -> Step:
    """Replay forward, loss and backward once, instrumented, and return what happened.

    Global state is restored on the way out, even when the replay raises: module
    hooks removed, modes popped, anomaly mode as it was. With
    backward_after_bad_loss=False a non-finite loss ends the replay there: the
    failure is then known and complete (fix verification needs no more). With
    stop_at_failure (fix verification too) backward also ends as soon as the failing
    gradient and its chain can no longer change (Recorder.stop_now), and the
    per-parameter walk is not made (`Step.grads` is empty; the failure, the events
    and the culprit are those of the whole replay). Events recorded once a parameter's gradient, complete,
    is known non-finite are past the failure's and on no chain: their output counts are None and their inputs
    unmeasured (Recorder.counted); `lazy_counts=False` counts every event.
    """
    rec = Recorder(names, site)
    rec.intercepts = intercepts or {}
    for t, who in (leaf_names or []):
        rec.leaf_names[t] = who
    rec.call_label = getattr(model, "current_user_call", None)  # a step program knows the user's calls
    rec.node_of = getattr(model, "current_node", None)  # ... and which of its nodes runs each op
    handles = rec.install_module_hooks() if site is None else []  # exported programs: the site knows
    node_handles: list = []
    model.zero_grad(set_to_none=True)
    loss_t = None
    backward_error = None
    try:
        with anomaly_off():  # it would raise mid-backward and hide the rest
            if prepare is not None:
                prepare()
            try:
                with _CallMode(rec), _OpMode(rec), autocast_from(autocast):
                    rec.phase = "forward"
                    output = forward()
                    rec.phase = "loss"
                    rec.module_stack[:] = [loss_module]
                    loss_t = loss(output)
                    rec.finish_forward()
            except NanReplayError:
                raise
            except Exception as e:  # noqa: BLE001 - user code
                raise ReplayError(_replay_error("forward" if rec.phase == "forward" else "loss", e, rec)) from e
            rec.phase = "backward"
            loss_finite = stats.finite_fast(loss_t.detach())
            skipped = not loss_finite and not backward_after_bad_loss
            if not (loss_t.requires_grad and loss_t.grad_fn is not None):
                backward_error = "the loss does not require grad: no backward pass to replay"
            elif not skipped:
                node_handles = rec.watch_anomaly(loss_t.grad_fn)
                # With a non-finite loss the failure is the loss: its chain is all forward, and backward
                # events could not change the culprit. Backward then runs uninstrumented; only the
                # anomaly-mode emulation watches it (armed from the start: NaN may flow from the loss).
                instrument = loss_finite
                rec.nan_in_backward = not instrument
                if instrument and lazy_counts:  # the failure known: count no more (and stop, if asked)
                    rec.stop_at_failure = stop_at_failure and _one_device(model)
                    node_handles += [p.register_post_accumulate_grad_hook(rec.grad_done)
                                     for p in model.parameters() if p.requires_grad]
                try:
                    # the call mode numbers Python-level calls in backward too (custom Functions' backward),
                    # so a fix can be verified there; C++ backward formulas never reach it
                    if instrument:
                        with _CallMode(rec), _OpMode(rec):
                            _backward(loss_t)
                    else:
                        loss_t.backward()
                except StopReplay:
                    pass
                except Exception as e:  # noqa: BLE001
                    raise ReplayError(_replay_error("backward", e, rec)) from e
    finally:
        for h in handles + node_handles:
            h.remove()
    failure = _failure(rec, loss_t, model)
    if failure is not None and failure.event is not None and rec.counted is not None \
            and failure.event >= rec.counted:
        # the failure is an event recorded past the first complete non-finite gradient (that gradient made
        # finite again later): its chain may hold uncounted events, so replay counting everything
        return run(model, forward, loss, names=names, prepare=prepare, autocast=autocast, site=site,
                   intercepts=intercepts, loss_module=loss_module, backward_after_bad_loss=backward_after_bad_loss,
                   stop_at_failure=stop_at_failure, leaf_names=leaf_names, lazy_counts=False)
    grads = gradient_rows(model) if not stop_at_failure else []
    anomaly = None if skipped else rec.anomaly or Anomaly(False)
    return Step(loss=float(loss_t.detach().double()) if loss_t is not None else None,
                events=rec.events, ops=rec.ops, op_by_seq=rec.op_by_seq, failure=failure, anomaly=anomaly,
                grads=grads, call_names=[call_name(f) for f in rec.call_funcs], user_calls=rec.user_calls,
                internal_errors=rec.internal_errors, backward_error=backward_error,
                activations=rec.activations, grad_shapes=rec.grad_shapes)


def run_patched(subject, intercepts: dict[int, Callable] | None, upstream=None) -> tuple[float, dict[str, float]] | None:
    """Forward, loss and backward with only the call-site patches in place (no op-level instrumentation):
    (loss, per-parameter gradient norms) when the loss and every gradient are finite, else None.

    Calls are numbered exactly as in `run`, so a patch keyed by call number lands on the same call. With
    `upstream` (replay/upstream.py: the forward up to the first patched call, shared by the candidates of one
    culprit; `subject` is then its copy) only the rest of the forward runs, and backward goes on through the shared
    graph, which it keeps.
    """
    rec = Recorder(subject.names, subject.site)
    rec.intercepts = intercepts or {}
    model = subject.model
    model.zero_grad(set_to_none=True)
    calls = _CallMode(rec) if intercepts else contextlib.nullcontext()
    with anomaly_off():
        if upstream is None and subject.prepare is not None:
            subject.prepare()
        with calls, autocast_from(subject.run_autocast):
            loss = subject.loss(subject.forward()) if upstream is None else upstream.forward(rec)
        if not stats.finite_fast(loss.detach()):
            return None
        if loss.requires_grad and loss.grad_fn is not None:
            # the answer is None as soon as one gradient, complete, is not finite: the rest of backward is not run
            hooks = [p.register_post_accumulate_grad_hook(lambda p: _finite_or_stop(p, rec))
                     for p in model.parameters() if p.requires_grad]
            try:
                with (_CallMode(rec) if intercepts else contextlib.nullcontext()):
                    ti.run_backward(loss)
                    if upstream is not None:
                        upstream.backward()
            except StopReplay:
                model.zero_grad(set_to_none=True)
                return None
            finally:
                for h in hooks:
                    h.remove()
    norms = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            v = grad_norm(p.grad.detach())
            if not math.isfinite(v):
                model.zero_grad(set_to_none=True)
                return None
            norms[n] = v
    model.zero_grad(set_to_none=True)
    return float(loss.detach().double()), norms


def outputs_at(subject, calls: set[int]) -> dict[int, Any]:
    """The outputs of the given calls (numbered exactly as in `run`) in one forward of `subject`, with no
    instrumentation: each detached, the rest of the step not run once the last of them has been made (its graph
    freed with it). Not under no_grad: a step program numbers its calls with autograd on (no_grad adds calls).
    Calls the forward does not make (a call in backward) are missing from the answer."""
    rec = Recorder(subject.names, subject.site)
    got: dict[int, Any] = {}
    last = max(calls, default=0)

    def keep(c: int):
        def fn(func, args, kwargs):
            out = func(*args, **kwargs)
            got[c] = (call_name(func), out.detach() if isinstance(out, torch.Tensor) else
                      type(out)(t.detach() if isinstance(t, torch.Tensor) else t for t in out)
                      if isinstance(out, (list, tuple)) and not hasattr(out, "_fields") else out)
            if c == last:
                raise StopReplay
            return out
        return fn
    rec.intercepts = {c: keep(c) for c in calls}
    with anomaly_off():
        if subject.prepare is not None:
            subject.prepare()
        try:
            with _CallMode(rec), autocast_from(subject.run_autocast):
                subject.loss(subject.forward())
        except StopReplay:
            pass
    return got


def _finite_or_stop(p: torch.Tensor, rec: Recorder) -> None:
    """A post-accumulate-grad hook of run_patched (not a numbered call: the Recorder is busy)."""
    rec.busy = True
    try:
        bad = p.grad is not None and not stats.finite_fast(p.grad)
    finally:
        rec.busy = False
    if bad:
        raise StopReplay


def grad_norm(g: torch.Tensor) -> float:
    """The L2 norm of a gradient: a cascaded float32 sum of squares (float32's own vector_norm accumulates less
    exactly; a float64 norm converts the whole tensor, several times slower), in float64 where the squares
    under- or overflow float32. A sparse or complex gradient counts its entries' real values."""
    if g.layout is not torch.strided or g.is_complex():
        g = ti.real_values(g)
    if g.dtype == torch.float32 and g.numel():
        v = math.sqrt(float(g.square().sum()))
        if math.isfinite(v) and v * v > 1e-30 * g.numel():  # (typical squares far from float32's subnormals)
            return v
    return float(torch.linalg.vector_norm(g, dtype=torch.float64))


def _one_device(model: torch.nn.Module) -> bool:
    """Every parameter on one device: backward runs one ready queue, the order Recorder.stop_now relies on."""
    return len({p.device for p in model.parameters()}) <= 1


def gradient_rows(model: torch.nn.Module) -> list[dict]:
    """The per-parameter gradient walk; a tied parameter is one row under all its names (`also`)."""
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        params[id(p)] = p
    for alias, target in (getattr(model, "aliases", None) or {}).items():  # a step program's tied names
        p = dict(model.named_parameters()).get(target)
        if p is not None and alias not in names[id(p)]:
            names[id(p)].append(alias)
    rows = []
    for key, p in params.items():
        row = stats.grad_stats(names[key][0], p)
        if len(names[key]) > 1:
            row["also"] = names[key][1:]
        rows.append(row)
    return rows


def _backward(loss: torch.Tensor) -> None:
    """loss.backward() without going through a torch function: under the call mode, Tensor.backward
    would itself be a numbered call, and the mode is switched off inside a call it handles — so the
    Python code backward runs (custom Functions) would go unseen."""
    ti.run_backward(loss)


def run_subject(subject, **kw) -> Step:
    """`run` for a rebuilt snapshot (a `replay.subject.Subject`)."""
    from nanreplay.replay.subject import batch_tensors

    leaves = [(t, (role, name)) for name, role, t in batch_tensors(subject)]
    leaves += [(p, ("parameter", n)) for n, p in subject.model.named_parameters()]
    return run(subject.model, subject.forward, subject.loss, names=subject.names, prepare=subject.prepare,
               autocast=subject.run_autocast, site=subject.site, leaf_names=leaves, **kw)


def autocast_from(setting: dict | None):
    """torch.autocast from a recorded setting, or nothing."""
    return torch.autocast(**setting) if setting else contextlib.nullcontext()


@contextlib.contextmanager
def anomaly_off():
    """Anomaly mode off for the duration (a replay must see the whole step); restored as it was, even on error."""
    was = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    torch.autograd.set_detect_anomaly(False)
    try:
        yield
    finally:
        torch.autograd.set_detect_anomaly(*was)


def _replay_error(stage: str, e: BaseException, rec: Recorder) -> str:
    where = ""
    if rec.ops:
        last = rec.ops[-1]
        where = f" (after {len(rec.ops)} ops; last in module {last.module or '<root>'!r}"
        fj = frame_json(last.frame)
        where += f", {fj['file']}:{fj['line']})" if fj else ")"
    return f"the {stage} pass raised {raised(e)}{where}"


def _failure(rec: Recorder, loss: torch.Tensor | None, model: torch.nn.Module) -> Failure | None:
    if loss is None:
        return None
    n, i = stats.kinds(loss.detach())
    if n or i:
        hit = rec.nonfinite.get(loss)
        ev = hit[0] if hit is not None else _last_forward_event(rec)
        return Failure("loss", "loss", Kind.NAN if n else Kind.INF, ev)
    best: Failure | None = None
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        n, i = stats.kinds(p.grad)
        if not (n or i):
            continue
        hit = rec.nonfinite.get(p.grad)
        ev = hit[0] if hit is not None else rec.by_storage.get(_storage_key(p.grad))
        cand = Failure("gradient", name, Kind.NAN if n else Kind.INF, ev)
        if best is None or (ev is not None and (best.event is None or ev < best.event)):
            best = cand
    return best


def _last_forward_event(rec: Recorder) -> int | None:
    fwd = [e.index for e in rec.events if e.phase == "forward"]
    return fwd[-1] if fwd else None
