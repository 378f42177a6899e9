"""NanGuard: the training-side half. A few lines in a plain loop; a snapshot when the step goes non-finite.

    guard = NanGuard(model, optimizer, loss_fn=F.cross_entropy, folder="nan_snapshots")
    for step, (x, y) in enumerate(loader):
        guard.begin(x, y, step=step)          # remembers the batch and the RNG state (cheap)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if not guard.loss_ok(loss):           # NaN/Inf loss: snapshot written
            break
        loss.backward()
        if not guard.grads_ok():              # NaN/Inf gradient with a finite loss: snapshot, before the update
            break
        optimizer.step()

On healthy steps the guard reads the loss once (the `.item()` most loops do for
logging anyway) and the total gradient norm (pass the value `clip_grad_norm_`
returned to avoid computing it twice). Everything heavy — CPU copies, the
torch.export of model and loss — happens only when a snapshot is written.

A failure to write (disk full, read-only folder) or to export never crashes
training: it is reported with `warnings`/logging and `last_snapshot` stays None.
This module imports only torch.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from nanreplay import __version__, atomic
from nanreplay import torch_internals as ti
from nanreplay.errors import GuardError, NonFiniteStep, first_line
from nanreplay.formats import native
from nanreplay.formats.native import FORMAT, VERSION
from nanreplay.pytree import map_tensors

log = logging.getLogger("nanreplay")


class NanGuard:
    """Writes a replayable snapshot the moment the loss or the gradients stop being finite.

    Args:
        model: the nn.Module being trained.
        optimizer: its optimizer (its state goes into the snapshot; needed by `step()`).
        loss_fn: the loss, called as loss_fn(output, target). torch.nn.functional
            functions (also functools.partial of them) and torch.nn loss modules are
            recorded as data; other callables are exported with the model, or
            recorded as MODULE:NAME (which then needs --trust to run).
            None: the model's output is the loss.
        folder: where snapshots go (created if missing).
        factory: "pkg.mod:build" that rebuilds the model, used if torch.export fails.
            Default: derived from the model's class (assumes a no-argument constructor).
        export: embed model+loss as a torch.export program (no training code needed to analyze).
        max_snapshots: at most this many snapshots per guard, so a run that keeps
            going NaN does not fill the disk.
        history: how many recent steps of loss / grad norm to keep for the report.
        spike_factor: also snapshot when the gradient norm exceeds this many times
            its running median (off by default; the step itself continues).
        scaler: a torch.amp.GradScaler. Non-finite gradients are then normal now and
            then (the scaler skips the step); only `scaler_patience` overflows in a row
            count as a failure.
        on_nonfinite: "return" (loss_ok/grads_ok return False) or "raise" (NonFiniteStep).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 loss_fn: Callable | None = None, folder: str | os.PathLike = "nan_snapshots", *,
                 factory: str | None = None, export: bool = True, max_snapshots: int = 3, history: int = 200,
                 spike_factor: float | None = None, spike_window: int = 50, scaler: Any = None,
                 scaler_patience: int = 10, autocast: dict | bool | None = None, on_nonfinite: str = "return"):
        if on_nonfinite not in ("return", "raise"):
            raise ValueError("on_nonfinite must be 'return' or 'raise'")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.folder = Path(folder)
        atomic.clean_stale_temps(self.folder, "nan_step")  # temp files of writes killed midway (kill -9)
        self.factory = factory
        self.export = export
        self.max_snapshots = max_snapshots
        self.spike_factor, self.spike_window = spike_factor, spike_window
        self.scaler, self.scaler_patience = scaler, scaler_patience
        self.on_nonfinite = on_nonfinite
        self.history: deque = deque(maxlen=history)
        self.snapshots: list[str] = []
        self.last_snapshot: str | None = None
        self.last_error: str | None = None
        self.step_index = -1
        self._inputs: Any = None
        self._target: Any = None
        self._rng: dict | None = None
        # autocast settings of the step: a dict (given), False (none), None (detect on the first loss_ok)
        self._autocast: dict | bool | None = _autocast_arg(autocast)
        self._overflows = 0
        self._custom_functions: list[str] | None = None  # custom autograd.Functions in the graph (None: not looked)
        self._in_step = False
        self._norms: deque = deque(maxlen=spike_window)
        self._cap_warned = False

    # ------------------------------------------------------------------ the loop's calls

    def begin(self, inputs: Any, target: Any = None, *, step: int | None = None) -> None:
        """Start of a step: remember the batch (by reference) and the RNG state the forward will use.

        `inputs` is what the model receives: a tensor (model(x)), a tuple (model(*x))
        or a dict (model(**x)).
        """
        self._new_step(step)
        self._inputs, self._target = inputs, target
        self._rng = {"cpu": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}

    def loss_ok(self, loss: torch.Tensor) -> bool:
        """After computing the loss, before backward(): False (and a snapshot) if it is NaN or Inf."""
        if not self._in_step:  # begin() was not called: still count steps
            self._new_step(None)
        value = float(loss.detach().float())  # the one host sync; most loops log this value anyway
        if self._custom_functions is None:  # once, on the first step: what does the autograd graph hold?
            try:
                found_autocast, self._custom_functions = _inspect_graph(loss, self.model)
            except Exception as e:  # noqa: BLE001 - an observer must never break the training step
                found_autocast, self._custom_functions = None, []
                log.debug("nanreplay: could not inspect the autograd graph: %s", e)
            if self._autocast is None:
                self._autocast = _autocast_state(self.model) or found_autocast or False
        self._record(loss=value)
        if math.isfinite(value):
            return True
        return self._fail("loss", loss_value=value)

    def grads_ok(self, grad_norm: float | torch.Tensor | None = None) -> bool:
        """After backward(), before optimizer.step(): False (and a snapshot) if a gradient is NaN or Inf.

        Pass the total norm you already have (what clip_grad_norm_ returned) to skip computing it.
        """
        norm = float(grad_norm) if grad_norm is not None else _total_norm(self.model)
        self._record(grad_norm=norm)
        self._in_step = False
        if not math.isfinite(norm):
            if self.scaler is not None:
                self._overflows += 1
                if self._overflows < self.scaler_patience:
                    return True  # the scaler skips this step and lowers its scale: business as usual
            return self._fail("gradient", grad_norm=norm)
        self._overflows = 0
        if self.spike_factor and len(self._norms) >= 10:
            med = statistics.median(self._norms)
            if med > 0 and norm > self.spike_factor * med:
                self._snapshot("grad_spike", grad_norm=norm)  # finite: record it, let the step go on
        self._norms.append(norm)
        return True

    def step(self, loss: torch.Tensor, *, clip: float | None = None) -> bool:
        """One call for the whole update: check, backward, check, optimizer.step().

        Returns False — with a snapshot written and the update skipped — when the
        loss or the gradients are non-finite. `clip` clips gradients to that norm.
        """
        if self.optimizer is None:
            raise GuardError("NanGuard.step() needs the optimizer: NanGuard(model, optimizer, ...)")
        if not self.loss_ok(loss):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
        else:
            loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))
        if not self.grads_ok(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return True

    # ------------------------------------------------------------------ internals

    def _new_step(self, step: int | None) -> None:
        self.step_index = self.step_index + 1 if step is None else step
        self._in_step = True
        self.history.append({"step": self.step_index, "loss": None, "grad_norm": None})

    def _record(self, **kv: float) -> None:
        if not self.history:
            self.history.append({"step": self.step_index, "loss": None, "grad_norm": None})
        self.history[-1].update(kv)

    def _fail(self, trigger: str, **extra: Any) -> bool:
        path = self._snapshot(trigger, **extra)
        if self.on_nonfinite == "raise":
            raise NonFiniteStep(trigger, path)
        return False

    def _snapshot(self, trigger: str, **extra: Any) -> str | None:
        self.last_snapshot = None
        if len(self.snapshots) >= self.max_snapshots:
            if not self._cap_warned:
                self._warn(f"not writing more than {self.max_snapshots} snapshots for this run "
                           f"(max_snapshots); already wrote {self.snapshots}")
                self._cap_warned = True
            return None
        try:
            path = self._write(trigger, extra)
        except Exception as e:  # noqa: BLE001 - never crash the training loop
            self.last_error = f"{type(e).__name__}: {e}"
            self._warn(f"could not write a snapshot for the non-finite {trigger} at step {self.step_index}: "
                       f"{self.last_error}")
            return None
        self.snapshots.append(path)
        self.last_snapshot = path
        log.warning("nanreplay: non-finite %s at step %s; snapshot written to %s", trigger, self.step_index, path)
        return path

    def _warn(self, msg: str) -> None:
        warnings.warn(f"nanreplay: {msg}", RuntimeWarning, stacklevel=4)
        log.warning("nanreplay: %s", msg)

    def _write(self, trigger: str, extra: dict) -> str:
        if self._inputs is None:
            raise RuntimeError("no batch: call guard.begin(inputs, target) at the start of each step")
        d = self.to_dict(trigger, extra)
        self.folder.mkdir(parents=True, exist_ok=True)
        rank = d["rank"]
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        base = f"nan_step{self.step_index:06d}" + (f"_rank{rank}" if rank is not None else "") + f"_{trigger}_{stamp}"
        for n in range(100):
            path = self.folder / (base + (f"_{n}" if n else "") + ".pt")
            try:
                atomic.write_with(path, lambda f: torch.save(d, f), overwrite=False)
                return str(path)
            except FileExistsError:
                continue
        raise RuntimeError(f"could not find a free file name for {base}.pt in {self.folder}")

    def to_dict(self, trigger: str, extra: dict | None = None) -> dict:
        """The native snapshot dict for the current step (CPU copies; loads with weights_only=True)."""
        extra = extra or {}
        model = self.model
        rank = world = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        param = next(model.parameters(), None)
        model_info = {"class": f"{type(model).__module__}.{type(model).__qualname__}",
                      "factory": self.factory or _derived_factory(model), "factory_source":
                      "given" if self.factory else "derived from the model's class",
                      "exported": None, "export_error": None}
        if self.export and self._custom_functions:
            model_info["export_error"] = (
                f"the model uses custom autograd.Function(s) {', '.join(self._custom_functions)}; torch.export "
                "keeps their forward but not their hand-written backward, so replay needs the model's code")
        elif self.export:
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model_info["exported"] = native.export_step(model, self.loss_fn, self._inputs, self._target)
            except Exception as e:  # noqa: BLE001 - data-dependent control flow, unsupported ops, ...
                model_info["export_error"] = f"{type(e).__name__}: {first_line(e, 500)}"
            model_info["export_seconds"] = round(time.perf_counter() - t0, 3)
        return {
            "format": FORMAT,
            "version": VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "nanreplay_version": __version__,
            "trigger": trigger,
            "step": self.step_index,
            "rank": rank,
            "world_size": world,
            "loss_value": extra.get("loss_value", _last(self.history, "loss")),
            "grad_norm": extra.get("grad_norm"),
            "batch": {"inputs": _cpu(self._inputs), "target": _cpu(self._target)},
            "model_state": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
            "model_training": model.training,
            "optimizer_state": _cpu(self.optimizer.state_dict()) if self.optimizer is not None else None,
            "model": model_info,
            "loss_spec": native.loss_spec(self.loss_fn),
            "rng": self._rng,
            "autocast": self._autocast or None,
            "grad_scale": float(self.scaler.get_scale()) if self.scaler is not None else None,
            "environment": {"torch": str(torch.__version__), "python": platform.python_version(),
                            "device": str(param.device) if param is not None else None,
                            "dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
                            "cuda": torch.version.cuda},
            "history": list(self.history),
        }


def _cpu(obj: Any) -> Any:
    """Deep CPU copy of every tensor in a nested structure (CUDA state may be poisoned; copies are safe)."""
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


def _last(history: deque, key: str) -> float | None:
    return history[-1].get(key) if history else None


def _total_norm(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])
    return float(torch.linalg.vector_norm(norms))


def _autocast_state(model: nn.Module) -> dict | None:
    p = next(model.parameters(), None)
    dev = p.device.type if p is not None else "cpu"
    if dev not in ("cpu", "cuda", "xpu", "mps") or not torch.is_autocast_enabled(dev):
        return None
    return {"device_type": dev, "dtype": str(torch.get_autocast_dtype(dev)).removeprefix("torch."), "enabled": True}


def _autocast_arg(autocast: dict | bool | None) -> dict | bool | None:
    if isinstance(autocast, dict):
        dt = autocast.get("dtype", torch.float16)
        return {"device_type": autocast.get("device_type", "cuda"), "dtype": str(dt).removeprefix("torch."),
                "enabled": True}
    return False if autocast is False else None


def _inspect_graph(loss: torch.Tensor, model: nn.Module, limit: int = 20000) -> tuple[dict | None, list[str]]:
    """Walk the autograd graph behind `loss` once (first step only).

    Returns the autocast setting the forward evidently ran under — ops that saved
    fp16/bf16 tensors while the weights are fp32, i.e. loss_ok() was called outside
    the autocast block — and the custom autograd.Functions the graph holds (their
    hand-written backward does not survive torch.export).
    """
    p = next(model.parameters(), None)
    check_dtype = p is not None and p.dtype == torch.float32
    autocast, custom = None, []
    seen, todo = set(), [loss.grad_fn]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
        if ti.is_custom_function_node(node):
            name = type(node).__name__.removesuffix("Backward")
            if name not in custom:
                custom.append(name)
        if autocast is not None or not check_dtype:
            continue
        for v in ti.saved_tensors_of(node):
            if v.dtype in (torch.float16, torch.bfloat16):
                autocast = {"device_type": v.device.type, "dtype": str(v.dtype).removeprefix("torch."), "enabled": True}
                break
    return autocast, custom


def _derived_factory(model: nn.Module) -> str | None:
    cls = type(model)
    if cls.__module__ in ("__main__", "builtins") or "<" in cls.__qualname__:
        return None
    return f"{cls.__module__}:{cls.__qualname__}"
