"""PyTorch Lightning: one line.

    from nanreplay.lightning import NanGuardCallback

    trainer = Trainer(..., callbacks=[NanGuardCallback("nan_snapshots")])

The callback keeps the batch and the RNG state in `on_train_batch_start`, checks the loss in
`on_before_backward` (for every micro-batch; Lightning's division by `accumulate_grad_batches` and
the 16-mixed GradScaler's scale are undone for the recorded value) and the gradients in
`on_before_optimizer_step` (after Lightning's unscale, before clipping and the update; a bad
micro-batch inside an accumulation window is found by running each micro-batch again). The step it
records is your `training_step` itself, with `self.log` muted, so whatever the loss is made of travels
in the snapshot. Manual optimization works too (the recorded loss is what `manual_backward` was given).
By default a non-finite step stops training with `nanreplay.errors.TrainingStopped`, which names the
snapshot; `on_nonfinite="skip"` drops that step's gradients instead and training goes on.

Works with `lightning` (`lightning.pytorch`) and the standalone `pytorch_lightning` package; imported
only when you import this module (`pip install 'nanreplay[lightning]'`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from nanreplay.capture import stopping
from nanreplay.capture.guard import NanGuard

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    try:
        from pytorch_lightning import Callback
    except ImportError as e:
        raise ImportError("nanreplay.lightning needs PyTorch Lightning: pip install 'nanreplay[lightning]'") from e

__all__ = ["NanGuardCallback"]

_SET_HERE = ("loss_fn", "step_fn", "scaler", "on_nonfinite")


class NanGuardCallback(Callback):
    """Writes a replayable snapshot when a training step's loss or gradients go NaN/Inf, and stops training.

    Args:
        folder: where snapshots go (created if missing).
        on_nonfinite: "raise" (default) stops training with `TrainingStopped` before the optimizer applies
            the step; "skip" drops the step's gradients (the optimizer leaves the weights alone) and goes on.
        **guard_options: any other NanGuard option (`max_snapshots=`, `spike_factor=`, `sync_ranks=`, ...).
    """

    def __init__(self, folder: str | os.PathLike = "nan_snapshots", *, on_nonfinite: str = "raise",
                 **guard_options: Any):
        self.folder = folder
        self.on_nonfinite = stopping.check_action(on_nonfinite)
        self.options = stopping.guard_options(guard_options, _SET_HERE, "NanGuardCallback")
        self.guard: NanGuard | None = None
        self._batch_idx: dict[int, int] = {}  # id(batch) -> batch_idx, for the micro-batches of this step
        self._failed = False  # this optimizer step already failed (on_nonfinite="skip")
        self._takes_idx = True
        self._scaler: Any = None

    # ------------------------------------------------------------------ Lightning hooks

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._takes_idx = _takes_batch_idx(pl_module.training_step)
        optimizers = trainer.optimizers
        options = dict(self.options)
        autocast = options.pop("autocast", None) or _autocast(trainer)
        self.guard = NanGuard(pl_module, optimizers[0] if len(optimizers) == 1 else None, folder=self.folder,
                              step_fn=self._training_step, scaler=self._scaler, autocast=autocast,
                              on_nonfinite="return", **options)
        self.guard._step_is_loops = True  # training_step is the loop's step: no first-step re-run to check it
        clip = getattr(trainer, "gradient_clip_val", None)  # clipped after on_before_optimizer_step: its norm is pre-clip
        algo = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm")
        self.guard.clip = float(clip) if clip and float(clip) > 0 and algo.endswith("norm") else None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.guard is None:
            return
        n = _accumulating(trainer, pl_module)
        micro = batch_idx % n if n > 1 else None
        if not micro:  # micro-batch 0 (or no accumulation): a new optimizer step
            self.guard.end_step()
            self._batch_idx.clear()
            self._failed = False
        self._batch_idx[id(batch)] = batch_idx
        self.guard.begin(batch, step=trainer.global_step, micro_batch=micro)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.guard is None or self._failed:
            return
        scale = self._scaler.get_scale() if self._scaler is not None else 1.0
        if not self.guard.loss_ok(loss, scaled_by=scale / _accumulating(trainer, pl_module)):
            self._failure()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.guard is None:
            return
        if not self._failed:
            several = len(trainer.optimizers) > 1  # manual optimization: each steps after its own manual_backward
            with torch.enable_grad():  # this hook runs inside optimizer.step(), under no_grad
                ok = self.guard.grads_ok(optimizer=optimizer if several else None)
            if not ok:
                self._failure()
        if self._failed:
            stopping.drop_gradients(p for g in optimizer.param_groups for p in g["params"])

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.guard is not None:
            self.guard.end_step()
            self._batch_idx.clear()

    # ------------------------------------------------------------------ the recorded step

    def _training_step(self, module: Any, batch: Any) -> torch.Tensor:
        """The step a snapshot records: the LightningModule's own training_step on this batch."""
        args = (batch, self._batch_idx.get(id(batch), 0)) if self._takes_idx else (batch,)
        manual = not module.automatic_optimization
        with _quiet(module), (_inert_optimization(module) if manual else contextlib.nullcontext([])) as losses:
            out = module.training_step(*args)
        if manual and losses:
            return losses[0] if len(losses) == 1 else torch.stack([x.reshape(()) for x in losses]).sum()
        return out.get("loss") if isinstance(out, Mapping) else out

    def _failure(self) -> None:
        self._failed = True
        if self.on_nonfinite == "raise":
            raise stopping.stopped(self.guard, "NanGuardCallback(..., on_nonfinite='skip')")


# ------------------------------------------------------------------ small pieces


def _accumulating(trainer: Any, pl_module: Any) -> int:
    """Micro-batches per optimizer step: Lightning divides the loss by this (automatic optimization only)."""
    return max(int(trainer.accumulate_grad_batches), 1) if pl_module.automatic_optimization else 1


def _autocast(trainer: Any) -> dict | None:
    precision = str(trainer.precision)
    if precision not in ("16-mixed", "bf16-mixed"):
        return None  # no autocast from Lightning (an autocast inside training_step is recorded as it runs)
    device = getattr(trainer.precision_plugin, "device", None) or trainer.strategy.root_device.type
    return {"device_type": str(device).split(":")[0],
            "dtype": torch.bfloat16 if precision == "bf16-mixed" else torch.float16}


def _takes_batch_idx(training_step: Any) -> bool:
    """Lightning passes batch_idx only when training_step has a second parameter (or *args)."""
    try:
        from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
    except ImportError:
        from pytorch_lightning.utilities.signature_utils import is_param_in_hook_signature
    return is_param_in_hook_signature(training_step, "batch_idx", min_args=2)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _patched(module: Any, **attrs: Any) -> Iterator[None]:
    """Instance attributes that shadow the module's methods for a while, then the methods again."""
    saved = {k: module.__dict__[k] for k in attrs if k in module.__dict__}
    for k, v in attrs.items():
        module.__dict__[k] = v
    try:
        yield
    finally:
        for k in attrs:
            module.__dict__.pop(k, None)
        module.__dict__.update(saved)


def _quiet(module: Any):
    """`self.log` / `self.log_dict` do nothing while the step runs again to be recorded."""
    return _patched(module, log=_noop, log_dict=_noop)


class _Inert:
    """An optimizer or scheduler as training_step sees it while the step is recorded: step() runs the closure
    (which calls manual_backward) and changes nothing; zero_grad() does nothing; the rest is the real one."""

    def __init__(self, real: Any):
        self._real = real

    def step(self, closure: Any = None, *args: Any, **kwargs: Any) -> Any:
        return closure() if callable(closure) else None

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _inert(x: Any) -> Any:
    if x is None:
        return None
    return [_Inert(o) for o in x] if isinstance(x, list) else _Inert(x)


@contextlib.contextmanager
def _inert_optimization(module: Any) -> Iterator[list[torch.Tensor]]:
    """Manual optimization, recorded: manual_backward() only collects its loss; optimizers and schedulers
    step nothing; clip_gradients does nothing. Yields the collected losses."""
    losses: list[torch.Tensor] = []
    real_optimizers, real_schedulers = module.optimizers, module.lr_schedulers

    def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        losses.append(loss)

    with _patched(module, manual_backward=manual_backward, clip_gradients=_noop,
                  optimizers=lambda use_pl_optimizer=True: _inert(real_optimizers(use_pl_optimizer)),
                  lr_schedulers=lambda: _inert(real_schedulers())):
        yield losses
