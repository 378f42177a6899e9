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
        optimizer.step()                      # the guard's step hook checks the weights right after the update
        if not guard.update_ok():             # NaN/Inf weights after the update: snapshot of the update
            break

Gradient accumulation: `begin(x, y, step=s, micro_batch=k)` for each micro-batch, `loss_ok` for each,
`grads_ok()` after each backward or only after the last one; the snapshot holds the micro-batch that
broke. A loss that is not `loss_fn(model(x), y)`: `NanGuard(model, opt, step_fn=fn)` with
`fn(model, batch) -> loss` and `begin(batch, step=s)`. GradScaler: pass `scaler=`; its routine
back-off is never a failure. DDP: `sync_ranks=True` makes every rank snapshot the same step.
FSDP2 (`fully_shard`, or `sharded=True`): all ranks write one sharded snapshot folder (docs/sharded.md); rank
agreement is on by itself there (turning it off is refused when the guard is made, not at the failure).

On healthy steps the guard reads the loss once (the `.item()` most loops do for logging anyway),
the total gradient norm (pass what `clip_grad_norm_` returned to skip computing it) and, from an
optimizer step post-hook, one fused norm of the weights after the update (`capture/update.py`).
Everything heavy — recording the step, CPU copies — happens only when a snapshot is written, and a
failure to write never crashes training: it is a warning (also under `-W error`) and `last_snapshot`
stays None. This module imports only torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from nanreplay import atomic
from nanreplay.capture import flow, losscheck, notify, owned, rerun, snapshot
from nanreplay.capture import modelstate as ms
from nanreplay.capture import sharded as sharded_capture
from nanreplay.capture import update as upd
from nanreplay.enums import Trigger
from nanreplay.errors import GuardError, NonFiniteStep
from nanreplay.replay.frames import user_frame

log = logging.getLogger("nanreplay")

_SAID = {Trigger.LOSS: "non-finite loss", Trigger.GRADIENT: "non-finite gradient",
         Trigger.GRAD_NORM_OVERFLOW: "gradient norm overflowed float32 (every gradient entry finite)",
         Trigger.GRAD_SPIKE: "gradient-norm spike (finite)", Trigger.UPDATE: "non-finite weights after the update",
         Trigger.NO_GRADIENT: "parameter(s) whose value reaches the loss but get no gradient",
         Trigger.GRADIENT_DIED: "parameter(s) whose gradient died (None or exactly zero while their value reaches "
                                "the loss)"}
_SAID[Trigger.GRADIENT_VANISHED] = "module(s) whose share of the gradient norm collapsed (capture/vanish.py)"
_SIDE = (Trigger.GRAD_SPIKE, Trigger.NO_GRADIENT, Trigger.GRADIENT_DIED, Trigger.GRADIENT_VANISHED)  # the step goes on


class NanGuard:
    """Writes a replayable snapshot the moment the loss or the gradients stop being finite.

    Args:
        model: the nn.Module being trained (DDP / torch.compile wrappers are fine: the module
            inside is what a snapshot records, under its own parameter names).
        optimizer: its optimizer (its state goes into the snapshot; needed by `step()`).
        loss_fn: the loss, called as loss_fn(output, target) with the model's output as it is (tuples, dicts).
            torch.nn.functional losses and torch.nn loss modules are recorded as data. None: the model's own loss
            (a scalar output, a `loss` key or attribute, or the one scalar in a tuple such as nanoGPT's `(logits, loss)`).
        folder: where snapshots go (created if missing).
        step_fn: instead of loss_fn: `fn(model, batch) -> loss` for losses computed any other way
            (several forward calls, no target, HF `labels`); then call `begin(batch, step=...)`.
        factory: "pkg.mod:build" naming code that rebuilds the model, for the rare step that cannot
            be recorded as a program (analysis then needs --trust). Default: the model's class.
        export: record the step as a program in the snapshot (no training code needed to analyze).
        max_snapshots: at most this many failure snapshots per guard (a run that keeps going NaN does not fill the
            disk), and one per batch (LBFGS's closure runs on); `max_spike_snapshots` separately bounds finite-spike ones.
        history: how many optimizer steps of loss / grad norm to keep for the report.
        spike_factor: also snapshot when the gradient norm exceeds this many times its running
            median (off by default; the step itself continues).
        scaler: a torch.amp.GradScaler. Scaled gradients that overflow are normal (the scaler skips
            the step and lowers its scale); only an overflow the scale cannot explain — at a scale
            of 1 or less — is a failure. Pass `loss_ok` the unscaled loss.
        autocast: the autocast setting of the forward, when loss_ok() is called outside the
            autocast block and it cannot be inferred ({"device_type": "cuda", "dtype": torch.float16}).
        on_nonfinite: "return" (loss_ok/grads_ok return False) or "raise" (NonFiniteStep).
        sync_ranks: under torch.distributed, agree across ranks at each check (one all-reduce of a world-size flag
            vector in loss_ok and in grads_ok), so that every rank writes a snapshot of the same step before any of
            them stops; the snapshots record which ranks were non-finite. Unset: on for sharded models (FSDP2,
            `sharded=True`), whose one snapshot folder needs every rank (False there is refused here), off otherwise.
        check_update: with an optimizer, check the weights right after every optimizer.step() (a step
            post-hook: one fused norm) and snapshot the update that made them non-finite (trigger
            "update"). On by default; `close()` (or dropping the guard) removes the hooks.
        keep_pre_step: copy the weights and the optimizer state before every step, so an update snapshot holds them
            exactly (memory: one copy of the parameters and of the optimizer state; time: one fused copy per step).
            Off: they are recovered from the state after the step where the update is invertible (SGD, Adam, AdamW),
            entries it overwrote with NaN/Inf replaced by stated stand-ins. A non-finite learning rate is always copied.
        scheduler: the LR scheduler, if any: its class and last learning rates go into update snapshots.
        check_flow: also snapshot trained parameters whose value reaches the loss but whose gradient is None or
            exactly zero ("no_gradient" / "gradient_died"), and modules whose share of the gradient norm collapses
            ("gradient_vanished"); a zero the loss does not depend on is a warning (docs/flow.md). False: off. A dict tunes it:
            {"patience": 3, "ignore": ["weight_hh"] (name substrings), "inert": True (snapshot those too),
            "all_zero_steps": N (N all-zero steps in a row write one), "vanish": 1e4, "vanish_floor": 1e-7 (None: off)}.
        identity: {"host", "device", "device_name", "run"} (each optional): this machine as your fleet names it,
            for triage's per-device count of transient failures (default: the hostname, the model's device, the
            run id of torchelastic/SLURM or of this process; capture/rerun.py `identity`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 loss_fn: Callable | None = None, folder: str | os.PathLike = "nan_snapshots", *,
                 step_fn: Callable | None = None, factory: str | None = None, export: bool = True,
                 max_snapshots: int = 3, max_spike_snapshots: int = 2, history: int = 200,
                 spike_factor: float | None = None, spike_window: int = 50, scaler: Any = None,
                 autocast: dict | bool | None = None, on_nonfinite: str = "return", sync_ranks: bool | None = None,
                 scaler_patience: int | None = None, check_update: bool = True, keep_pre_step: bool = False,
                 scheduler: Any = None, sharded: bool | None = None, identity: dict | None = None,
                 check_flow: bool | dict = True):
        if on_nonfinite not in ("return", "raise"):
            raise ValueError("on_nonfinite must be 'return' or 'raise'")
        if step_fn is not None and loss_fn is not None:
            raise ValueError("give loss_fn or step_fn, not both")
        self.wrapped = model  # as given: DDP / torch.compile wrappers included
        self.model = snapshot.unwrap(model)  # the user's own module: what a snapshot records
        self.optimizer, self.loss_fn, self.step_fn = optimizer, loss_fn, step_fn
        self.folder = Path(folder)
        self.upload_to: str | None = None  # folder="s3://...": written locally, then uploaded whole (remote.py)
        if isinstance(folder, str) and "://" in folder:
            from nanreplay import remote

            self.upload_to, self.folder = folder, Path(remote.staging_folder(folder))
        atomic.clean_stale_temps(self.folder, "nan_step")  # temp files of writes killed midway (kill -9)
        self.factory, self.export = factory, export
        self.max_snapshots, self.max_spike_snapshots = max_snapshots, max_spike_snapshots
        self.spike_factor, self.spike_window = spike_factor, spike_window
        self.scaler = scaler
        self.on_nonfinite = on_nonfinite
        self.sync_ranks = ms.rank_agreement(self.model, sync_ranks, sharded)
        self.sharded = sharded
        self.history: deque = deque(maxlen=history)
        self.clip: float | None = None  # the max_norm gradients are clipped to, where a trainer says (history "clip")
        self.snapshots: list[str] = []  # failure snapshots
        self.spike_snapshots: list[str] = []
        self.flow_snapshots: list[str] = []  # dead-gradient ones (capped by max_spike_snapshots too)
        self._flow = flow.FlowWatch(**check_flow) if isinstance(check_flow, dict) else \
            flow.FlowWatch() if check_flow else None
        self.last_snapshot: str | None = None
        self.last_error: str | None = None
        self.last_trigger: Trigger | None = None  # why the last failure snapshot was (or would have been) written
        self.step_index = -1
        self.micro_batch: int | None = None
        self._states: list[snapshot.StepState] = []  # one per micro-batch of the current optimizer step
        self._checked = -1  # the last micro-batch whose accumulated gradients were checked finite
        self._buffers = snapshot.BufferWatch(self.model)
        self._autocast: dict | bool | None = ms.autocast_arg(autocast)  # None: infer on the first loss_ok
        self._inspected = False
        self._in_step = False
        self._norms: deque = deque(maxlen=spike_window)
        self._warned: set[str] = set()
        self._bad_ranks: list[int] | None = None
        del scaler_patience  # accepted for old code; overflows at a scale > 1 are never failures now
        self.scheduler = scheduler
        self.identity = rerun.identity_arg(identity)
        self._norm_given = False  # grads_ok() was given the norm (clip_grad_norm_ may have rescaled the gradients)
        self._update_failed, self._step_snapshot = False, None  # the update broke the weights; this batch's snapshot
        self._broken_by: str | None = None  # the update snapshot written when the weights broke
        self._watch = None
        self._record_loss: Callable | None = loss_fn  # the loss a recording uses (the loop's own, after the check)
        self._loss_note: str | None = None
        self._check_pending = True  # the first loss_ok() checks that the guard's loss is the loop's
        self._step_is_loops = False  # step_fn is the framework's own step (a trainer integration): nothing to check
        self._calls = losscheck.CallWatch(self) if step_fn is None else None
        inner = upd.unwrap_optimizer(optimizer)  # accelerate's / Lightning's wrappers hold the torch optimizer
        if inner is not None and check_update:
            try:
                self._watch = upd.UpdateWatch(self, inner, NanGuard._update_failure, NanGuard._update_healthy,
                                              keep_pre_step)
            except Exception as e:  # noqa: BLE001 - the update check is an extra: never a reason to fail training
                self._warn_once("update-hooks", f"cannot watch the optimizer's updates ({type(e).__name__}: {e}); "
                                                "NaN/Inf written by optimizer.step() is caught one step late")

    def close(self) -> None:
        """Remove the optimizer hooks (also done when the guard is garbage-collected)."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._calls is not None:
            self._calls.close()
            self._calls = None

    @property
    def flow_watch(self) -> flow.FlowWatch | None:
        """check_flow's state: `all_zero_count` (all-zero steps), `inert` (parameter -> the step it was warned of)."""
        return self._flow

    def __enter__(self) -> NanGuard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop's calls

    def begin(self, inputs: Any, target: Any = None, *, step: int | None = None,
              micro_batch: int | None = None) -> None:
        """Start of a (micro-)batch: remember it (by reference) and the RNG state its forward will use.

        `inputs` is what the model receives: a tensor (model(x)), a tuple (model(*x)) or a dict
        (model(**x)); with `step_fn`, the whole batch. Micro-batches of one optimizer step share
        `step` and count `micro_batch` 0, 1, 2, ...
        """
        new_step = (step is None and (micro_batch is None or micro_batch == 0)) or step != self.step_index \
            or not self._in_step
        if new_step:
            self._new_step(step)
        self.micro_batch, self._step_snapshot = micro_batch, None
        rng = {"cpu": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
               "host": owned.host_rng()}
        batch = {"batch": inputs} if self.step_fn is not None else {"inputs": inputs, "target": target}
        self._states.append(snapshot.StepState(batch, rng, self._buffers.begin(), micro_batch, entry=user_frame(2)))

    def loss_ok(self, loss: torch.Tensor, *, scaled_by: float | torch.Tensor | None = None) -> bool:
        """After the forward, before backward(): False (and a snapshot) if the loss is NaN or Inf.

        `scaled_by`: the factor a framework already multiplied the loss by (a GradScaler's scale, 1/N for
        N accumulation steps); the loss recorded is divided by it, so it is the loss the step computed.
        """
        if not self._in_step:  # begin() was not called: still count steps
            self._new_step(None)
        if not isinstance(loss, torch.Tensor):  # a number (`loss.item()`): checked as it is, no graph to look at
            loss = torch.tensor(float(loss))
        # the one host sync (most loops log this value anyway); per-sample losses: their mean, non-finite if one is
        value = float(loss.detach().float() if loss.numel() == 1 else loss.detach().float().mean())
        factor = float(scaled_by) if scaled_by is not None else 1.0
        if factor != 1.0 and factor != 0.0 and math.isfinite(factor):
            value = value / factor
        if not self._inspected:  # once: did the forward run under autocast (loss_ok called outside the block)?
            self._inspected = True
            if self._autocast is None:
                self._autocast = ms.autocast_state(self.model) or ms.saved_low_precision(loss, self.model) or False
        if self._check_pending:  # once: is the loss a recording computes the loss the loop checks?
            losscheck.first_step(self, loss, value)
        if self._states:
            self._states[-1].loss, self._states[-1].loss_scaled = value, factor != 1.0
        row = self._row()
        row["loss"] = value if self.micro_batch is None or row.get("loss") is None else row["loss"] + value
        bad = self._agree(not math.isfinite(value))
        if not bad:
            return True
        return self._fail(Trigger.LOSS, loss_value=value)

    def grads_ok(self, grad_norm: float | torch.Tensor | None = None, *, clip: float | None = None,
                 optimizer: Any = None) -> bool:
        """After backward(), before optimizer.step(): False (and a snapshot) if a gradient is NaN or Inf.

        Pass the total norm you already have (what clip_grad_norm_ returned: the norm *before* clipping, which
        the history needs to see a climb) to skip computing it, and `clip`, the max_norm you clip to (the
        advice then knows clipping is already in force). Under gradient accumulation it may be called after
        every micro-batch or only after the last. Where one guard watches several optimizers, each stepping after
        its own backward (a GAN's two), pass the one about to step: only its parameters must have a gradient now."""
        if self._check_pending and self._calls is not None:  # loss_ok() is not called: nothing to check against
            self._calls.want_output, self._calls.output = False, None
        norm = float(grad_norm) if grad_norm is not None else None
        if self._flow is not None:
            try:
                measured = self._flow.measure(self.model, upd.unwrap_optimizer(optimizer or self.optimizer), self.step_index,
                                              want_norm=norm is None)
                norm = measured if norm is None else norm
            except Exception as e:  # noqa: BLE001 - the flow check is an extra: never a reason to fail training
                self._flow = None
                self._warn_once("flow", f"cannot check gradient flow ({type(e).__name__}: {e}); switched off")
        if norm is None:
            norm = ms.total_norm(self.model)
        self._norm_given = grad_norm is not None
        trigger = None
        if not math.isfinite(norm):
            entries_finite = ms.all_grads_finite(self.model)
            if entries_finite:  # a float32 norm of finite, huge gradients: the norm overflowed, not the values
                exact = ms.total_norm(self.model, torch.float64)
                # clip_grad_norm_ that returned inf has already scaled every gradient by max_norm / inf = 0
                norm = exact if exact > 0 else norm
                trigger = Trigger.GRAD_NORM_OVERFLOW
            else:
                trigger = Trigger.GRADIENT
        row = self._row()
        row["grad_norm"] = norm
        clip = clip if clip is not None else self.clip
        if clip is not None and math.isfinite(float(clip)) and float(clip) > 0:
            row["clip"] = float(clip)
        inner = upd.unwrap_optimizer(self.optimizer)
        if inner is not None:
            self._update_healthy(inner)  # the learning rate this update will use, for the history
        if trigger == Trigger.GRADIENT and self.scaler is not None:
            scale = float(self.scaler.get_scale())
            row["scale"] = scale
            if scale > 1.0:
                row["overflow"] = True  # the scaler skips this step and backs off: business as usual
                return not self._agree(False)
        bad = self._agree(trigger is not None)
        if bad:
            state = self._culprit_micro_batch() if trigger == Trigger.GRADIENT else None
            return self._fail(trigger or Trigger.GRADIENT, grad_norm=norm, state=state)
        self._checked = len(self._states) - 1
        self._spike(norm)
        if self._flow is not None:
            self._flow_check(norm)
        return True

    def update_ok(self) -> bool:
        """After optimizer.step(): False (and a snapshot, trigger "update") if the update made a weight NaN or Inf."""
        return not self._update_failed

    def step(self, loss: torch.Tensor, *, clip: float | None = None) -> bool:
        """One call for the whole update: check, backward, check, optimizer.step().

        Returns False — with a snapshot written and the update skipped — when the loss or the
        gradients are non-finite. `clip` clips gradients to that norm.
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
        ok = self.grads_ok(norm, clip=clip)
        if self.scaler is not None:
            if ok:
                self.scaler.step(self.optimizer)  # skips the update itself when the scaled gradients overflowed
            self.scaler.update()  # always: unscale_() was called, and the next step needs a fresh scaler state
        elif ok:
            self.optimizer.step()
        if not ok:
            self.optimizer.zero_grad(set_to_none=True)
        return ok and not self._update_failed

    def end_step(self) -> None:
        """The optimizer step is over (the accumulation boundary): the next begin() starts a new step even
        if it passes the same `step` number. Trainer integrations call it; plain loops need not."""
        self._in_step = False

    # ------------------------------------------------------------------ bookkeeping

    def _new_step(self, step: int | None) -> None:
        self.step_index = self.step_index + 1 if step is None else step
        self._in_step = True
        self._states = []
        self._checked = -1
        self.micro_batch = None
        self._update_failed, self._step_snapshot = False, None
        self.history.append({"step": self.step_index, "loss": None, "grad_norm": None})

    def _row(self) -> dict:
        if not self.history or self.history[-1]["step"] != self.step_index:
            self.history.append({"step": self.step_index, "loss": None, "grad_norm": None})
        return self.history[-1]

    def _agree(self, bad: bool) -> list[int]:
        """The ranks that saw a non-finite value at this check ([] when none); with sync_ranks all ranks agree."""
        rank = ms.rank()
        if not (self.sync_ranks and rank is not None):
            return [rank or 0] if bad else []
        dist = torch.distributed
        dev = next(self.model.parameters()).device if dist.get_backend() == "nccl" else torch.device("cpu")
        flags = torch.zeros(dist.get_world_size(), device=dev)
        flags[rank] = float(bad)
        dist.all_reduce(flags)
        ranks = [i for i, v in enumerate(flags.tolist()) if v]
        if ranks and self._bad_ranks is None:
            self._bad_ranks = ranks
        return ranks

    def _spike(self, norm: float) -> None:
        if self.spike_factor and len(self._norms) >= 10:
            med = statistics.median(self._norms)
            if med > 0 and norm > self.spike_factor * med:
                self._snapshot(Trigger.GRAD_SPIKE, {"grad_norm": norm, "spike_median": med})
        self._norms.append(norm)

    def _flow_check(self, norm: float) -> None:
        """Trained parameters with no (or a zero) gradient this step whose value reaches the loss: a snapshot (the
        step goes on). A re-run only on a step where such a parameter was seen (capture/flow.py)."""
        try:
            found = flow.check(self._flow, self)
        except Exception as e:  # noqa: BLE001 - never break training
            self._warn_once("flow-check", f"could not check gradient flow ({type(e).__name__}: {e})")
            return
        if found is not None:
            self._snapshot(found[0], {"grad_norm": norm, "gradient_flow": found[1]})

    def _culprit_micro_batch(self) -> snapshot.StepState | None:
        """The micro-batch whose gradient is non-finite, when the accumulated check cannot tell."""
        unchecked = self._states[self._checked + 1:]
        if len(unchecked) <= 1 or not self.export or sharded_capture.wanted(self.model, self.sharded):
            # (sharded: re-running backward is a collective this rank alone would start)
            return None
        try:
            with self._calls_paused():
                return snapshot.first_nonfinite_micro_batch(self.model, unchecked, self._forward_loss,
                                                            self._autocast or None) or unchecked[-1]
        except Exception as e:  # noqa: BLE001 - finding it is a courtesy; never break training
            log.debug("nanreplay: could not find the micro-batch that broke the gradients: %s", e)
            return None

    # ------------------------------------------------------------------ the update check (optimizer hooks)

    def _update_healthy(self, optimizer: torch.optim.Optimizer) -> None:
        """Log the learning rate (the first group's, when it is a plain number) in the history."""
        lr = upd.hyperparameters({"lr": optimizer.param_groups[0].get("lr")}).get("lr") if optimizer.param_groups \
            else None  # (a numpy float from a schedule becomes a Python one)
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            self._row()["lr"] = float(lr)
        base = optimizer.param_groups[0].get("initial_lr") if optimizer.param_groups else None  # a scheduler's
        base = upd.hyperparameters({"lr": base}).get("lr") if base is not None else None  # configured lr
        if isinstance(base, (int, float)) and not isinstance(base, bool) and math.isfinite(base):
            self._row()["base_lr"] = float(base)

    def _update_failure(self, optimizer: torch.optim.Optimizer, step_kwargs: dict) -> None:
        self._update_failed = True
        watch = self._watch
        try:
            record, weights = upd.update_record(optimizer, self.model, watch.pre if watch else None,
                                                scheduler=self.scheduler, step_kwargs=step_kwargs)
        except Exception as e:  # noqa: BLE001 - never crash the training loop
            self.last_error = f"{type(e).__name__}: {e}"
            self._warn_once("update-record", f"the update at step {self.step_index} made the weights non-finite, "
                                             f"but what it needs could not be gathered: {self.last_error}")
            return
        finally:
            if watch is not None:
                watch.pre.forget()
        self._fail(Trigger.UPDATE, update=record, pre_weights=weights)

    # ------------------------------------------------------------------ writing

    def _fail(self, trigger: Trigger, **extra: Any) -> bool:
        self.last_trigger = trigger
        if self._broken_by is not None and trigger != Trigger.UPDATE:
            # an update this guard wrote a snapshot of broke the weights: a snapshot one step late would say so again
            self._warn_once("late", f"the {_SAID[trigger]} at step {self.step_index} follows from the update that "
                                    f"made the weights non-finite (snapshot {self._broken_by}); no new snapshot")
            path = self._broken_by
        elif self._step_snapshot is not None:  # LBFGS's closure runs on after a failure, into the update it broke
            path = self._step_snapshot
            self._warn_once("same-step", f"the {_SAID[trigger]} at step {self.step_index} follows from the failure "
                                         f"already written for this batch ({path}); no new snapshot")
        else:
            path = self._step_snapshot = self._snapshot(trigger, extra)
            if trigger == Trigger.UPDATE and path is not None:
                self._broken_by = path
        if self.on_nonfinite == "raise":
            raise NonFiniteStep(trigger, path, _SAID[trigger])
        return False

    def _snapshot(self, trigger: Trigger, extra: dict) -> str | None:
        spike = trigger in _SIDE
        taken, cap = ((self.spike_snapshots if trigger == Trigger.GRAD_SPIKE else self.flow_snapshots),
                      self.max_spike_snapshots) if spike else (self.snapshots, self.max_snapshots)
        if not spike:
            self.last_snapshot = None
        if len(taken) >= cap:
            self._warn_once(f"cap:{spike}", f"not writing more than {cap} {'spike ' if spike else ''}snapshots for "
                                            f"this run ({'max_spike_snapshots' if spike else 'max_snapshots'}); "
                                            f"already wrote {taken}")
            return None
        try:
            path = self._write(trigger, extra)
        except Exception as e:  # noqa: BLE001 - never crash the training loop
            self.last_error = f"{type(e).__name__}: {e}"
            self._warn_once(f"write:{type(e).__name__}", f"could not write a snapshot for the {_SAID[trigger]} at "
                                                         f"step {self.step_index}: {self.last_error}")
            return None
        if self.upload_to is not None:
            path = self._upload(path)
        taken.append(path)
        if not spike:
            self.last_snapshot = path
        st = extra.get("state")  # the micro-batch that broke, when it is not the current one
        mb = st.micro_batch if st is not None else self.micro_batch
        micro = f" (micro-batch {mb})" if mb is not None else ""
        log.warning("nanreplay: %s at step %s%s; snapshot written to %s", _SAID[trigger], self.step_index, micro, path)
        return path

    def _upload(self, path: str) -> str:
        """The snapshot uploaded whole into `upload_to`: its URL; on failure one warning and the local path."""
        url, err = notify.upload(path, self.upload_to)
        if err:
            self.last_error = err
            self._warn_once("upload", f"could not upload the snapshot to {self.upload_to} ({err}); it stays at {path}")
        return url

    def _warn_once(self, key: str, msg: str) -> None:
        notify.warn_once(self._warned, key, msg)

    def _write(self, trigger: Trigger, extra: dict) -> str:
        if not self._states and trigger != Trigger.UPDATE:
            raise GuardError("no batch: call guard.begin(inputs, target) at the start of each step")
        if sharded_capture.wanted(self.model, self.sharded):
            return sharded_capture.write(self, trigger, extra)
        d = self.to_dict(trigger, extra)
        self.folder.mkdir(parents=True, exist_ok=True)
        rank = d["rank"]
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        micro = f"_micro{d['micro_batch']}" if d.get("micro_batch") is not None else ""
        base = (f"nan_step{self.step_index:06d}{micro}" + (f"_rank{rank}" if rank is not None else "")
                + f"_{trigger}_{stamp}")
        for n in range(100):
            path = self.folder / (base + (f"_{n}" if n else "") + ".pt")
            try:
                atomic.write_with(path, lambda f: torch.save(d, f), overwrite=False)
                return str(path)
            except FileExistsError:
                continue
        raise GuardError(f"could not find a free file name for {base}.pt in {self.folder}")

    def _forward_loss(self, st: snapshot.StepState):
        if self.step_fn is not None:
            return snapshot.step_forward(self.model, st.batch["batch"], self.step_fn)
        st = self._as_called(st)
        return snapshot.loss_forward(self.model, st.batch["inputs"], st.batch["target"], self._record_loss)

    def _as_called(self, st: snapshot.StepState) -> snapshot.StepState:
        """The step with the inputs the loop's model call actually got, where begin() was given others."""
        got = losscheck.call_inputs(st.call)
        if self.step_fn is not None or got is None or losscheck.same_inputs(got, st.batch.get("inputs")):
            return st
        if "call" not in self._warned:
            self._warned.add("call")
            log.info("nanreplay: the model was called with other arguments than the inputs given to begin(); "
                     "snapshots record the call the loop made")
        return snapshot.StepState({"inputs": got, "target": st.batch.get("target")}, st.rng, st.buffers, st.micro_batch)

    def _recorded_loss_fn(self) -> Callable | None:
        """The loss a snapshot names: None (the model's own) where the recording picks it from the output."""
        if self._record_loss is self.loss_fn or getattr(self._record_loss, "loss_fn", None) is self.loss_fn:
            return self.loss_fn  # (loss_fn itself, or loss_fn on the one element of the output the loop gave it)
        return None

    def _calls_paused(self):
        return contextlib.nullcontext() if self._calls is None else self._calls.looking_away()

    def to_dict(self, trigger: str, extra: dict | None = None) -> dict:
        """The native snapshot dict for the current step (CPU copies; loads with weights_only=True)."""
        extra = dict(extra or {})
        pre = extra.pop("pre_weights", None)
        if pre is not None:  # an update snapshot: the step as it began, with the weights before the update
            with upd.weights_set_to(self.model, pre), torch.enable_grad():  # (a step() under no_grad is common)
                return self._to_dict(trigger, extra)
        return self._to_dict(trigger, extra)

    def _to_dict(self, trigger: str, extra: dict) -> dict:
        st = extra.pop("state", None) or (self._states[-1] if self._states else None)
        program, constants, why, seconds = None, {}, "recording was switched off (export=False)", 0.0
        t0, watch, seen = time.perf_counter(), None, {}
        training = rerun.training_summary(self, trigger, st)  # before the re-run: what the training step left
        if st is None:
            st, why = snapshot.StepState({}, {}), "no batch: begin() was not called for this step"
        elif self.export:
            st = self._as_called(st)
            run = snapshot.rerun_copy(st)  # the re-run's own batch: the snapshot keeps the loop's (st)
            forward, loss = self._forward_loss(run)
            watch = rerun.RandomWatch(st.rng)
            with self._calls_paused():
                program, constants, why, seconds = snapshot.record(self.model, run, forward, loss,
                                                                   self._autocast or None, watch=watch, seen=seen)
            if program is None:
                self.last_error = why
                self._warn_once("record", f"the step could not be recorded as a program ({why}); analyzing its "
                                          "snapshot will need the model's code (--model, or --trust for its factory)")
        notes: list[str] = [n for n in (self._loss_note, ms.backward_hooks_note(self.model)) if n]
        extra["record_seconds"] = round(seconds, 3) if program is not None else None
        extra.setdefault("loss_value", self._row().get("loss"))
        extra["micro_batch"] = st.micro_batch
        if self._bad_ranks is not None:
            extra["nonfinite_ranks"] = list(self._bad_ranks)
        extra["machine"] = rerun.identity(self.model, self.identity)
        if trigger != Trigger.UPDATE:  # an update's failure is in optimizer.step(), which the re-run does not repeat
            extra["rerun"] = rerun.guard_record(self, trigger, st, training, seen.pop("loss", None), watch, why, t0)
        return snapshot.build(model=self.model, wrapped=self.wrapped, state=st, trigger=trigger, step=self.step_index,
                              extra=extra, program=program, constants=constants, program_error=why,
                              loss_fn=self._recorded_loss_fn(), step_fn=self.step_fn,
                              optimizer=upd.unwrap_optimizer(self.optimizer),
                              scaler=self.scaler, autocast=self._autocast or None, history=list(self.history),
                              factory=self.factory, notes=notes, scheduler=self.scheduler)
