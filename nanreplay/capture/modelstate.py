"""What the guard reads of the model and the process it trains in: rank agreement, the rank, gradient norms,
the autocast in force, and whether a low-precision loss was saved. Small, torch-only, no state."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from nanreplay import torch_internals as ti
from nanreplay.capture import sharded as sharded_capture
from nanreplay.errors import GuardError

log = logging.getLogger("nanreplay")


def rank_agreement(model: nn.Module, sync_ranks: bool | None, sharded: bool | None) -> bool:
    """sync_ranks as given; unset, on exactly where a snapshot is a folder every rank writes (FSDP2, sharded=True),
    which needs every rank to stop at the same check. Off there: refused now, never found out at the failure."""
    folder = bool(sharded) or sharded_capture.wanted(model, sharded)
    if sync_ranks is None:
        return folder
    if not sync_ranks and folder:
        raise GuardError("NanGuard(..., sync_ranks=False) on a sharded model: its snapshot is one folder every rank "
                         "writes, so every rank must stop at the same step; leave sync_ranks unset (it is on for "
                         "sharded models) or pass sharded=False for one file per rank")
    return bool(sync_ranks)


def rank() -> int | None:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def total_norm(model: nn.Module, dtype: torch.dtype = torch.float32) -> float:
    """The global gradient norm; in float64 it cannot overflow for any finite float32/fp16/bf16 gradients."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norms = ti.foreach_norm(grads, dtype)
    return float(torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms])))


def all_grads_finite(model: nn.Module) -> bool:
    """Every gradient entry finite (False when there are no gradients to look at)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return bool(grads) and all(bool(torch.isfinite(ti.real_values(g)).all()) for g in grads)


def autocast_state(model: nn.Module) -> dict | None:
    p = next(model.parameters(), None)
    dev = p.device.type if p is not None else "cpu"
    if dev not in ("cpu", "cuda", "xpu", "mps") or not torch.is_autocast_enabled(dev):
        return None
    return {"device_type": dev, "dtype": str(torch.get_autocast_dtype(dev)).removeprefix("torch."), "enabled": True}


def autocast_arg(autocast: dict | bool | None) -> dict | bool | None:
    if isinstance(autocast, dict):
        dt = autocast.get("dtype", torch.float16)
        return {"device_type": autocast.get("device_type", "cuda"), "dtype": str(dt).removeprefix("torch."),
                "enabled": True}
    return False if autocast is False else None


def saved_low_precision(loss: torch.Tensor, model: nn.Module, limit: int = 20000) -> dict | None:
    """The autocast the forward evidently ran under: ops that saved fp16/bf16 tensors while the weights are
    fp32 (loss_ok() was called after the autocast block). Walks the autograd graph once, first step only.

    Not where any weight is itself fp16/bf16: a model the code cast (`model.half()`, a body in half with a norm
    kept in float32, `x.half()` into it) saves low-precision tensors without any autocast — those casts are the
    code's own, and advice about autocast would not apply to it."""
    p = next(model.parameters(), None)
    if p is None or p.dtype != torch.float32 or loss.grad_fn is None:
        return None
    if any(q.dtype in (torch.float16, torch.bfloat16) for q in model.parameters()):
        return None
    try:
        for node in ti.autograd_nodes(loss.grad_fn, limit):
            for v in ti.saved_tensors_of(node):
                if v.dtype in (torch.float16, torch.bfloat16):
                    return {"device_type": v.device.type, "dtype": str(v.dtype).removeprefix("torch."), "enabled": True}
    except Exception as e:  # noqa: BLE001 - an observer must never break the training step
        log.debug("nanreplay: could not inspect the autograd graph: %s", e)
    return None


HOOKS_NOTE = "backward hooks ran in training that a replay does not run"  # read by diagnose/finite.py


def backward_hooks_note(model: nn.Module) -> str | None:
    """A snapshot note naming the Python backward hooks the step ran (a replay holds no Python, so it computes the
    gradients without them): when the replay's gradients are finite and the training's were not, they are the
    likeliest source."""
    found = ti.backward_hooks(model)
    if not found:
        return None
    return f"{HOOKS_NOTE}: " + ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
