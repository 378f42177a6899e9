"""Hugging Face Trainer: one line.

    from nanreplay.transformers import NanGuardCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NanGuardCallback("nan_snapshots")])
    # or: trainer.add_callback(NanGuardCallback("nan_snapshots"))

Trainer callbacks never see the batch or the loss, so the callback hooks the model's forward: the
forward pre-hook keeps the batch exactly as the model gets it (labels and `num_items_in_batch`
included) and the RNG state; the forward hook checks the loss inside the `ModelOutput` for every
micro-batch, before backward; `on_pre_optimizer_step` checks the gradients before the optimizer
applies them (a bad micro-batch inside an accumulation window is found by running each again).
The step a snapshot records is the model's forward with its own loss.

When the loss is not the model's own — a `compute_loss_func`, label smoothing
(`label_smoothing_factor`), or a Trainer subclass with its own `compute_loss` — the Trainer takes the
labels out of the batch before the forward, where no callback can see them. Then also call
`nanreplay.transformers.attach(trainer)`: it adds the callback if needed and records the Trainer's
`compute_loss` instead (the callback warns once when the model returned no loss).

By default a non-finite step stops training with `nanreplay.errors.TrainingStopped`, which names the
snapshot; `on_nonfinite="skip"` drops that step's gradients instead. Imported only when you import this
module (`pip install 'nanreplay[transformers]'`).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch

from nanreplay.capture import stopping
from nanreplay.capture.guard import NanGuard

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError("nanreplay.transformers needs Hugging Face transformers: "
                      "pip install 'nanreplay[transformers]'") from e

__all__ = ["NanGuardCallback", "attach"]

log = logging.getLogger("nanreplay")
_SET_HERE = ("loss_fn", "step_fn", "on_nonfinite")
_NO_LOSS = ("the model returned no loss, so nanreplay checks only the gradients and cannot record the step: the "
            "Trainer took the labels out of the batch (a compute_loss_func, label smoothing or your own "
            "compute_loss). Call nanreplay.transformers.attach(trainer) before trainer.train()")


class NanGuardCallback(TrainerCallback):
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
        self._compute_loss: Any = None  # the Trainer's own compute_loss, once attach() wrapped it
        self._hooks: list[Any] = []
        self._accumulation = 1
        self._step = 0
        self._micro = 0
        self._busy = False  # the guard is running the step again: hooks stand aside
        self._failed = False
        self._warned = False
        self._pre_clip: float | None = None  # this step's gradient norm before the Trainer clipped it

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self._remove_hooks()
        self._accumulation = max(int(args.gradient_accumulation_steps), 1)
        options = dict(self.options)
        options.setdefault("scaler", getattr(optimizer, "scaler", None))
        options.setdefault("autocast", _autocast(optimizer))
        if self._compute_loss is not None:
            self.guard = NanGuard(model, optimizer, folder=self.folder, step_fn=self._recorded_compute_loss,
                                  on_nonfinite="return", **options)
            self.guard._step_is_loops = True  # the Trainer's compute_loss is the loop's: no first-step re-run
        else:
            self.guard = NanGuard(model, optimizer, loss_fn=None, folder=self.folder, on_nonfinite="return",
                                  **options)
            self._hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                           model.register_forward_hook(self._after_forward, with_kwargs=True)]
        self._step, self._micro, self._failed = state.global_step, 0, False
        self.guard.clip = float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else None
        self._pre_clip = None
        _watch_clipping(self)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.end_step()  # the first micro-batch of an optimizer step
        self._step, self._micro, self._failed = state.global_step, 0, False
        self._pre_clip = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.guard is None:
            return
        if not self._failed:
            self._busy = True
            try:
                with torch.enable_grad():  # the norm before the Trainer clipped, where it was seen
                    ok = self.guard.grads_ok(self._pre_clip)
            finally:
                self._busy = False
            if not ok:
                self._failure()
        if self._failed:
            stopping.drop_gradients(self.guard.model.parameters())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_hooks()
        if self.guard is not None:
            self.guard.end_step()

    # ------------------------------------------------------------------ the forward, hooked

    def _before_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.guard is None or self._busy or not module.training or not torch.is_grad_enabled():
            return
        batch = _as_keywords(module, args, kwargs)
        if batch is None:  # not a batch the guard can call the model with: no snapshot of a stale one either
            self.guard.end_step()
            return
        self._begin(batch)

    def _after_forward(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if self._busy or not module.training or not torch.is_grad_enabled():
            return
        loss = _model_loss(output)
        if loss is None:
            if not self._warned:
                self._warned = True
                log.warning("nanreplay: %s", _NO_LOSS)
            return
        self._check_loss(loss)

    def _begin(self, batch: Any) -> None:
        if self.guard is None:
            return
        micro = self._micro if self._accumulation > 1 else None
        self._micro += 1
        self.guard.begin(batch, step=self._step, micro_batch=micro)

    def _check_loss(self, loss: torch.Tensor) -> None:
        if self.guard is None or self._failed:
            return
        self._busy = True
        try:
            ok = self.guard.loss_ok(loss)
        finally:
            self._busy = False
        if not ok:
            self._failure()

    def _failure(self) -> None:
        self._failed = True
        if self.on_nonfinite == "raise":
            raise stopping.stopped(self.guard, "NanGuardCallback(..., on_nonfinite='skip')")

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ attach(): the Trainer's compute_loss

    def _recorded_compute_loss(self, model: Any, batch: dict) -> torch.Tensor:
        """The step a snapshot records under attach(): the Trainer's compute_loss on this micro-batch."""
        loss = self._compute_loss(model, dict(batch["inputs"]), num_items_in_batch=batch["num_items_in_batch"])
        return loss[0] if isinstance(loss, tuple) else loss


def attach(trainer: Any, folder: str | os.PathLike = "nan_snapshots", **options: Any) -> NanGuardCallback:
    """Guard a Trainer whose loss is not the model's own: record `trainer.compute_loss` as the step.

    Needed with `compute_loss_func=`, `label_smoothing_factor > 0` or a subclass that overrides
    `compute_loss`; harmless otherwise. Adds a NanGuardCallback (`folder`, `**options`) unless the trainer
    already has one, and returns it. Call it before `trainer.train()`.
    """
    cb = next((c for c in trainer.callback_handler.callbacks if isinstance(c, NanGuardCallback)), None)
    if cb is None:
        cb = NanGuardCallback(folder, **options)
        trainer.add_callback(cb)
    elif options:
        raise stopping.GuardError("the trainer already has a NanGuardCallback: give the options to it, not attach()")
    if cb._compute_loss is not None:
        return cb
    original = trainer.compute_loss
    cb._compute_loss = original

    def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None,
                     **kwargs: Any) -> Any:
        active = not cb._busy and model.training and torch.is_grad_enabled()
        if active:
            cb._begin({"inputs": dict(inputs), "num_items_in_batch": num_items_in_batch})  # before labels are popped
        result = original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch,
                          **kwargs)
        if active:
            cb._check_loss(result[0] if isinstance(result, tuple) else result)
        return result

    trainer.compute_loss = compute_loss
    return cb


# ------------------------------------------------------------------ small pieces


def _watch_clipping(cb: NanGuardCallback) -> None:
    """Keep the gradient norm the Trainer's `_clip_grad_norm` returns — the norm *before* it clipped (after
    clipping every step reads about max_grad_norm, and a climb is invisible). The Trainer is the caller that
    is running on_train_begin (callbacks are never given it); where it is not found, or has no such method,
    the guard measures the gradients itself, after clipping."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        handler = getattr(owner, "callback_handler", None)
        if handler is not None and cb in getattr(handler, "callbacks", ()):
            break
    else:
        return
    clip = getattr(owner, "_clip_grad_norm", None)
    if clip is None or getattr(clip, "_nanreplay", False):
        return

    def clip_grad_norm(*args: Any, **kwargs: Any) -> Any:
        norm = clip(*args, **kwargs)
        try:
            cb._pre_clip = float(norm)
        except (TypeError, ValueError, RuntimeError):
            cb._pre_clip = None
        return norm

    clip_grad_norm._nanreplay = True
    owner._clip_grad_norm = clip_grad_norm


def _as_keywords(module: Any, args: tuple, kwargs: dict) -> Any:
    """The forward's arguments as one dict (the Trainer calls model(**inputs)); positional ones bound by name.
    None when they cannot be told apart (positional arguments into *args next to keywords)."""
    if not args:
        return dict(kwargs)
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = None
    if bound is None or any(sig.parameters[n].kind is inspect.Parameter.VAR_POSITIONAL for n in bound):
        return tuple(args) if not kwargs else None
    out: dict = {}
    for name, value in bound.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _model_loss(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _autocast(optimizer: Any) -> dict | None:
    """The autocast accelerate wraps the model's forward in, as the Trainer set it up (None: let the guard see)."""
    state = getattr(optimizer, "accelerator_state", None)
    mixed = str(getattr(state, "mixed_precision", "no"))
    device = getattr(getattr(state, "device", None), "type", None)
    if mixed == "bf16" and device:
        return {"device_type": device, "dtype": torch.bfloat16}
    if mixed == "fp16" and device and device != "cpu":  # fp16 on the CPU trains in float32
        return {"device_type": device, "dtype": torch.float16}
    return None
