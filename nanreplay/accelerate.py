"""Hugging Face Accelerate: a NanGuard that knows the accelerator.

    from nanreplay.accelerate import guard_for

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    guard = guard_for(accelerator, model, optimizer, loss_fn=F.cross_entropy, folder="nan_snapshots")
    for x, y in loader:
        with accelerator.accumulate(model):
            guard.begin(x, y)                  # step and micro-batch come from the accelerator
            loss = F.cross_entropy(model(x), y)
            if not guard.loss_ok(loss):        # the loss as computed: before backward() scales and divides it
                break
            accelerator.backward(loss)
            if accelerator.sync_gradients:     # the accumulation boundary
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscaled under fp16
                if not guard.grads_ok(norm, clip=1.0):  # the norm before clipping, and the clip in force
                    break
            optimizer.step()
            optimizer.zero_grad()

`guard_for` fills in what the accelerator knows: its GradScaler (fp16), the autocast it wraps the
forward in (bf16/fp16), the model inside its wrappers (the snapshot records your module under its
own parameter names) and the accumulation boundary (`accelerator.sync_gradients`): `begin()` numbers
optimizer steps and micro-batches by itself. Everything else is the plain NanGuard API.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from nanreplay.capture.guard import NanGuard

__all__ = ["AcceleratedGuard", "guard_for"]


class AcceleratedGuard(NanGuard):
    """NanGuard for a model prepared by an `accelerate.Accelerator` (see `guard_for`)."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any = None, loss_fn: Callable | None = None,
                 folder: str | os.PathLike = "nan_snapshots", **options: Any):
        options.setdefault("scaler", getattr(accelerator, "scaler", None))
        options.setdefault("autocast", _autocast(accelerator))
        super().__init__(accelerator.unwrap_model(model), optimizer, loss_fn, folder, **options)
        self.wrapped = model  # as prepared (DDP, compiled): the snapshot's environment says so
        self.accelerator = accelerator
        self._next_step = 0  # optimizer steps begun so far
        self._micro = 0  # micro-batches begun in the current accumulation window

    def begin(self, inputs: Any, target: Any = None, *, step: int | None = None,
              micro_batch: int | None = None) -> None:
        """Start of a (micro-)batch, inside `with accelerator.accumulate(model):` when accumulating. Without
        `step`/`micro_batch` they come from the accelerator: a window ends where `sync_gradients` is True."""
        if step is None and micro_batch is None:
            step, micro_batch = self._position()
        super().begin(inputs, target, step=step, micro_batch=micro_batch)

    def _position(self) -> tuple[int, int | None]:
        step, micro = self._next_step, self._micro
        if micro == 0:
            self.end_step()
        if self.accelerator.sync_gradients:  # this micro-batch closes the window
            self._next_step, self._micro = step + 1, 0
        else:
            self._micro = micro + 1
        accumulating = int(getattr(self.accelerator, "gradient_accumulation_steps", 1) or 1) > 1
        return step, (micro if accumulating else None)


def guard_for(accelerator: Any, model: torch.nn.Module, optimizer: Any = None, loss_fn: Callable | None = None,
              folder: str | os.PathLike = "nan_snapshots", **options: Any) -> AcceleratedGuard:
    """A NanGuard for `model` (as `accelerator.prepare` returned it) with the accelerator's scaler, autocast,
    unwrapped model and accumulation boundary filled in. `loss_fn`, `folder` and `**options` are NanGuard's."""
    return AcceleratedGuard(accelerator, model, optimizer, loss_fn, folder, **options)


def _autocast(accelerator: Any) -> dict | None:
    """The autocast accelerate wraps the forward in (None: none, or let the guard see for itself)."""
    if not getattr(accelerator, "native_amp", False):
        return None  # no autocast (fp16 on the CPU trains in float32)
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed)
    if dtype is None:
        return None
    return {"device_type": accelerator.device.type, "dtype": dtype}
