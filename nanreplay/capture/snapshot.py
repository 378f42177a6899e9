"""Building a native snapshot (format 2) from the live training state: what the guard writes.

`StepState` is what `NanGuard.begin()` keeps for the step (the batch by reference, the RNG
state, copies of the buffers the forward changes in place); `build()` records the step as a
program from exactly that state and returns the dict `torch.save` writes. Everything here
is copied to the CPU; the live model, its buffers and the RNG are left as they were.
"""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch
import torch.nn as nn

from nanreplay import __version__
from nanreplay.capture import construct, owned, plain, recipe, sites, usersource
from nanreplay.capture.owned import storage_freed
from nanreplay.capture.program import FREED, ModuleHooks, NotRecordable, frame_record, record_step
from nanreplay.errors import first_line
from nanreplay.formats.loss_spec import loss_spec
from nanreplay.formats.native import FORMAT, VERSION
from nanreplay.replay.subject import call_model, compute_loss, forward_parameter_names

_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's own module inside DDP / DataParallel / FSDP(1) `.module` and torch.compile's `_orig_mod`."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = getattr(model, "module", None)
        if type(model).__name__ in _WRAPPERS and isinstance(inner, nn.Module):
            model = inner
            continue
    return model


def is_compiled(model: nn.Module) -> bool:
    return any(isinstance(getattr(m, "_orig_mod", None), nn.Module) for m in (model, getattr(model, "module", None))
               if m is not None)


@dataclass
class StepState:
    """What one step began with."""

    batch: Any  # {"inputs": ..., "target": ...} or {"batch": ...}
    rng: dict
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> copy, for buffers forward mutates
    micro_batch: int | None = None
    call: tuple | None = None  # (args, kwargs) the loop's model call got (capture/losscheck.py CallWatch)
    loss: float | None = None  # the loss loss_ok() read for this micro-batch (unscaled)
    loss_scaled: bool = False  # loss_ok() was given scaled_by: the value was divided, not read as the step made it
    entry: tuple | None = None  # the user's line that called begin(): where the batch enters the step (file, line, fn)


class BufferWatch:
    """Keeps copies of the buffers a forward changes in place (BatchNorm's running stats), as of begin().

    Which buffers those are is learned on the first step: every buffer is copied then, and at the
    next begin() those whose value or version counter moved are the ones to keep copying. (Kernels
    such as batch_norm write running stats without bumping the version, hence the values.)
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.mutating: set[str] | None = None  # None: not known yet
        self._first: dict[str, tuple[torch.Tensor, int]] = {}

    def begin(self) -> dict[str, torch.Tensor]:
        bufs = dict(self.model.named_buffers())
        if self.mutating is None and self._first:
            self.mutating = {n for n, b in bufs.items()
                             if n not in self._first or b._version != self._first[n][1]
                             or b.shape != self._first[n][0].shape or not torch.equal(b, self._first[n][0])}
            self._first = {}
        names = bufs.keys() if self.mutating is None else self.mutating
        with torch.no_grad():
            copies = {n: bufs[n].detach().clone() for n in names if n in bufs}
        if self.mutating is None:
            self._first = {n: (t, bufs[n]._version) for n, t in copies.items()}
        return copies


def cpu_copy(obj: Any) -> Any:
    """Deep CPU copy of a nested batch. Tensors that share storage (inputs and shifted targets cut from one
    tensor) keep sharing it, so they are stored once; a view of some larger tensor the batch does not hold
    (a slice of a dataset) is copied alone, never its whole base."""
    leaves = [t for t in _tensors(obj)]
    for t in leaves:
        if storage_freed(t):  # copying it would read past its storage (a segfault)
            raise RuntimeError(FREED)
    groups: dict[int, list[torch.Tensor]] = {}
    for t in leaves:
        try:
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
        except (RuntimeError, NotImplementedError):
            pass
    spans: dict[int, tuple[torch.Tensor, int]] = {}  # storage -> (copied span, its first element's offset)
    for key, ts in groups.items():
        if len({id(t) for t in ts}) < 2 or len({t.dtype for t in ts}) > 1 or not key:
            continue
        lo = min(t.storage_offset() for t in ts)
        hi = max(owned.storage_end(t) for t in ts if t.numel())
        base = ts[0].detach()
        flat = base.as_strided((hi - lo,), (1,), lo).to("cpu", copy=True)
        spans[key] = (flat, lo)
    memo: dict[int, torch.Tensor] = {}

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            t = memo.get(id(x))
            if t is None:
                try:
                    span = spans.get(x.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):
                    span = None
                if span is not None:
                    flat, lo = span
                    t = flat.as_strided(x.size(), x.stride(), x.storage_offset() - lo)
                else:
                    t = dense(x.detach()).to("cpu", copy=True)
                memo[id(x)] = t
            return t
        if isinstance(x, dict):  # keys a snapshot can hold (plain.batch_key): the program names tensors by them
            return {plain.batch_key(k): copy(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return tuple(copy(v) for v in x)
        if isinstance(x, list):
            return [copy(v) for v in x]
        # numpy scalars and arrays, enums, ... become plain values or tensors; what is not data becomes its
        # repr (the program records what the step did with it)
        return plain.data(x, keep_tuples=True)
    return copy(obj)


DENSE_LIMIT = 1 << 24  # elements: a sparse tensor recorded dense takes at most 64 MB in float32


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` as the snapshot format carries it: a sparse tensor (a GCN's COO adjacency in the batch or a buffer) in its
    dense form, which the analysis can load; the format holds dense tensors only, and refuses any other layout."""
    if t.layout is torch.strided:
        return t
    if t.numel() > DENSE_LIMIT:
        raise RuntimeError(f"a {str(t.layout).removeprefix('torch.')} tensor of shape {tuple(t.shape)} is too large to "
                           f"record dense (more than {DENSE_LIMIT} elements), and a snapshot holds dense tensors only")
    return t.to_dense()


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


@contextlib.contextmanager
def from_begin_state(model: nn.Module, state: StepState, autocast: dict | None) -> Iterator[None]:
    """Run the step again as it began, on state the guard owns (capture/owned.py): the RNG state and buffers of
    begin(), the step's autocast, grad on (a hook inside optimizer.step() runs under no_grad; the step did not).
    The training's tensors, gradients and generators are left exactly as they were."""
    with owned.rerun_state(model, state.rng, state.buffers), torch.enable_grad(), autocast_context(autocast):
        yield


def rerun_copy(state: StepState) -> StepState:
    """The step with its batch, and the model call the loop made, as tensors the re-run owns (capture/owned.py
    `clone_tensors`): a forward that writes its inputs in place writes these, never the loop's."""
    batch, call = owned.clone_tensors((state.batch, state.call))
    return StepState(batch, state.rng, state.buffers, state.micro_batch, call, state.loss, state.loss_scaled,
                     state.entry)


def record(model: nn.Module, state: StepState, forward: Callable[[], Any], loss: Callable[[Any], torch.Tensor],
           autocast: dict | None, hooks: ModuleHooks | None = None, *, watch: Any = None,
           seen: dict | None = None) -> tuple[dict | None, dict, str | None, float]:
    """Replay the step from its begin() state under the recorder; the live state is restored afterwards.

    `hooks`: work around module calls the program must not see (FSDP2 gathering a unit's parameters).
    `watch`: told every op the re-run makes (capture/rerun.py); `seen["loss"]`: the loss tensor the re-run
    computed, recordable or not (its graph alive, for the re-run's gradients).

    Returns (program or None, constants, why there is no program, seconds).
    """
    t0 = time.perf_counter()
    if seen is not None:
        def loss_seen(out, _loss=loss):
            seen["loss"] = value = _loss(out)
            return value
        loss = loss_seen
    try:
        with from_begin_state(model, state, autocast):
            rec = record_step(forward, loss, model=model, batch=state.batch, hooks=hooks, watch=watch)
        return rec.program, rec.constants, None, time.perf_counter() - t0
    except NotRecordable as e:
        return None, {}, str(e), time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the user's step raised when run again: no program
        return None, {}, f"running the step again to record it raised {type(e).__name__}: {first_line(e, 300)}", \
            time.perf_counter() - t0


def autocast_context(autocast: dict | None):
    """The step's autocast, unless it is on already (loss_ok() called inside the autocast block)."""
    return torch.autocast(**_autocast_kwargs(autocast)) if autocast and not _autocast_on(autocast) else _nullcontext()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _autocast_kwargs(ac: dict) -> dict:
    dt = ac.get("dtype", "float16")
    return {"device_type": ac.get("device_type", "cuda"), "dtype": getattr(torch, dt) if isinstance(dt, str) else dt}


def _autocast_on(ac: dict) -> bool:
    try:
        return torch.is_autocast_enabled(ac.get("device_type", "cuda"))
    except Exception:  # noqa: BLE001
        return False


def first_nonfinite_micro_batch(model: nn.Module, states: list[StepState], forward_loss: Callable,
                                autocast: dict | None) -> StepState | None:
    """Run forward and backward of each micro-batch again, alone, from its begin() state; the first whose
    own gradient is non-finite. Runs on state the guard owns (`from_begin_state`) and takes the gradients with
    `torch.autograd.grad`: nothing accumulates into `.grad`, no post-accumulate hook fires."""
    for st in states:
        params = [p for p in model.parameters() if p.requires_grad]
        with from_begin_state(model, st, autocast):
            forward, loss = forward_loss(rerun_copy(st))
            value = loss(forward())
        grads = torch.autograd.grad(value, params, allow_unused=True)  # (outside autocast, as backward() ran)
        if not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
            return st
        del grads, value
    return None


def loss_forward(model: nn.Module, inputs: Any, target: Any, loss_fn: Callable | None):
    """(forward, loss) callables for the classic `loss_fn(model(inputs), target)` step."""
    return (lambda: call_model(model, inputs)), (lambda out: compute_loss(out, target, loss_fn))


def step_forward(model: nn.Module, batch: Any, step_fn: Callable):
    """(forward, loss) callables for a `step_fn(model, batch) -> loss` step."""
    return (lambda: step_fn(model, batch)), (lambda out: out)


def build(*, model: nn.Module, wrapped: nn.Module, state: StepState, trigger: str, step: int, extra: dict,
          program: dict | None, constants: dict, program_error: str | None, loss_fn: Callable | None,
          step_fn: Callable | None, optimizer: Any, scaler: Any, autocast: dict | None, history: list,
          factory: str | None, notes: list[str], scheduler: Any = None) -> dict:
    """The snapshot dict: plain data and CPU tensors only, loadable with weights_only=True."""
    rank = world = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    param = next(model.parameters(), None)
    params = dict(model.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    aliases = {}
    for name, p in params.items():
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    state_dict = {name: p.detach().to("cpu", copy=True) for name, p in params.items() if name not in aliases}
    for name, b in model.named_buffers():  # non-persistent buffers too: the program may read them
        b = state.buffers.get(name, b)  # as the step began
        state_dict[name] = dense(b.detach()).to("cpu", copy=True)
    layouts = sorted({str(t.layout).removeprefix("torch.") for t in [*_tensors(state.batch), *model.buffers()]
                      if t.layout is not torch.strided})
    if layouts:
        notes = [*notes, f"{', '.join(layouts)} tensors of the batch or buffers recorded dense (a snapshot holds dense "
                 "tensors only): a replay gives the step their dense form"]
    sources = usersource.Sources()  # the user's files, each read and parsed once for this snapshot
    spec = loss_spec(loss_fn) if step_fn is None else {"kind": "step_fn", "spec": _qualname(step_fn)}
    d = {
        "format": FORMAT,
        "version": VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "nanreplay_version": __version__,
        "trigger": str(trigger),
        "step": step,
        "micro_batch": extra.get("micro_batch"),
        "nonfinite_ranks": extra.get("nonfinite_ranks"),
        "spike_median": extra.get("spike_median"),
        "gradient_flow": extra.get("gradient_flow"),  # trigger no_gradient / gradient_died (capture/flow.py)
        "record_seconds": extra.get("record_seconds"),  # how long recording the step program took
        "rank": rank,
        "world_size": world,
        "loss_value": extra.get("loss_value"),
        "grad_norm": extra.get("grad_norm"),
        "grad_scale": float(scaler.get_scale()) if scaler is not None else None,
        "batch": cpu_copy(state.batch),
        "state": state_dict,
        "parameters": [n for n in params if n not in aliases],
        "input_names": forward_parameter_names(model),
        "aliases": aliases,
        "model_training": model.training,
        "constants": {k: v.detach().to("cpu") for k, v in constants.items()},
        "step_program": _json(program) if program is not None else None,
        "program_error": program_error,
        "model": model_record(model, factory),
        "loss_spec": spec,
        "optimizer": _optimizer_record(optimizer, model, post_step_state=extra.get("update") is None),
        "update": extra.get("update"),
        "rng": {"cpu": state.rng.get("cpu"), "cuda": state.rng.get("cuda")},
        "autocast": _autocast_record(autocast),
        "environment": {"torch": str(torch.__version__), "python": platform.python_version(),
                        "device": str(param.device) if param is not None else None,
                        "dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
                        "cuda": torch.version.cuda, "compiled": is_compiled(wrapped),
                        "wrapper": type(wrapped).__name__ if wrapped is not model else None},
        "history": [dict(h) for h in history],
        "notes": notes,
        "constructions": construct.records(model, program, sources),  # where each nn.Sequential was built (construct.py)
        "entry": entry_record(state.entry),  # the line that gave begin() the batch (a data remedy's edit goes there)
        "rerun": extra.get("rerun"),  # the guard's re-run beside the training step (capture/rerun.py)
        "machine": extra.get("machine"),  # which host, device and run wrote it
        # where the optimizer, scheduler and autocast were made, with evidence (capture/sites.py)
        "sites": sites.record(model, optimizer, scheduler, autocast, history, sources),
    }
    # only data: whatever training code left in these fields (numpy scalars from a schedule, enums, ...) becomes
    # plain values, so the file loads with weights_only=True and no pickled object (the batch is copied above)
    return {k: v if k == "batch" else plain.data(v, keep_tuples=True, tensor=_cpu) for k, v in d.items()}


def entry_record(frame: tuple | None) -> dict | None:
    """The frame of the begin() call as a snapshot frame (its line and context read now), or None."""
    if not frame:
        return None
    try:
        return frame_record(frame[0], frame[1], frame[2])
    except (OSError, UnicodeDecodeError, TypeError):  # an observer never raises into the loop
        return None


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.detach().to("cpu")


def _optimizer_record(optimizer: Any, model: nn.Module, post_step_state: bool) -> dict | None:
    """The optimizer's class, its state dict (left out of update snapshots, whose `update` field holds the
    state before the step) and the parameter name of each index the state dict uses."""
    if optimizer is None:
        return None
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    try:
        state = plain.data(optimizer.state_dict()) if post_step_state else None
    except Exception:  # noqa: BLE001 - a state the optimizer will not give costs that field, never the snapshot
        # ZeroRedundancyOptimizer gives its state only after a collective (consolidate_state_dict) that every rank
        # must join: never called here. The optimizer it runs on this rank's shard (`.optim`) gives its own.
        local = getattr(optimizer, "optim", None)
        if isinstance(local, torch.optim.Optimizer) and local is not optimizer:
            return _optimizer_record(local, model, post_step_state)
        state = None
    order = [names.get(id(p), "") for g in optimizer.param_groups for p in g["params"]]
    return {"class": type(optimizer).__name__, "state_dict": state, "param_names": order}


def _json(program: dict) -> str:
    from nanreplay.formats.program import to_json

    return to_json(program)


def _autocast_record(ac: dict | None) -> dict | None:
    if not ac:
        return None
    dt = ac.get("dtype", "float16")
    return {"device_type": ac.get("device_type", "cuda"), "dtype": str(dt).removeprefix("torch."), "enabled": True}


def _qualname(fn: Callable) -> str | None:
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{mod}:{qual}" if mod and qual and "<" not in qual else None


def model_record(model: nn.Module, factory: str | None) -> dict:
    """The snapshot's `model` field: the class, and how --trust can build it again (capture/recipe.py)."""
    spec, arguments, source = recipe.recipe(model, factory)
    rec = {"class": f"{type(model).__module__}.{type(model).__qualname__}", "factory": spec, "factory_source": source}
    if arguments is not None:
        rec["arguments"] = arguments
    return rec
