"""Rebuilding an eager step: a model the user's code builds, the snapshot's weights, its batch."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from nanreplay.errors import ModelError, UsageError, first_line
from nanreplay.formats.base import Snapshot
from nanreplay.replay.subject import Subject, forward_parameter_names, to_device

_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile


def _strip_prefixes(state: dict, own: dict) -> dict:
    for p in _PREFIXES:
        if state and not (state.keys() & own.keys()) and all(k.startswith(p) for k in state):
            state = {k[len(p):]: v for k, v in state.items()}
    return state


def state_misfit(model: nn.Module, state: dict[str, torch.Tensor]) -> str:
    """What in `state` does not fit `model` (missing and unexpected keys, shapes), in words; "" when it fits."""
    own = model.state_dict()
    state = _strip_prefixes(state, own)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} (snapshot {list(state[k].shape)}, model {list(own[k].shape)})"
              for k in own if k in state and state[k].shape != own[k].shape]
    parts = []
    for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", shapes)):
        if keys:
            more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
            parts.append(f"{label}: {', '.join(keys[:5])}{more}")
    return "; ".join(parts)


def load_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a snapshot's state dict, naming exactly what does not fit.

    Floating tensors keep the snapshot's dtype (a model trained in fp16 must
    replay in fp16, whatever dtype the factory builds it in).
    """
    state = _strip_prefixes(state, model.state_dict())
    misfit = state_misfit(model, state)
    if misfit:
        raise ModelError(f"the snapshot's state dict does not fit the model: {misfit}")
    with torch.no_grad():
        tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        for name, t in tensors:
            s = state.get(name)
            if s is not None and s.is_floating_point() and t.is_floating_point() and s.dtype != t.dtype:
                t.data = t.data.to(s.dtype)
    model.load_state_dict(state)


def parse_device(spec: str | None) -> torch.device:
    """The replay device: `cpu` [default], or one this machine has (`cuda`, `cuda:1`, `mps`, ...); else one line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "'mkldnn' is no longer used as device type"
            dev = torch.device(spec or "cpu")
    except (RuntimeError, ValueError, TypeError) as e:
        raise UsageError(f"--device {spec!r}: {first_line(e)}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise UsageError(f"--device {spec!r}: meta tensors hold no values, so no step can be replayed on them "
                         "(use --device cpu)")
    if not _available(dev.type):
        name = "CUDA" if dev.type == "cuda" else dev.type
        raise UsageError(f"--device {spec!r}: {name} is not available on this machine (use --device cpu)")
    count = getattr(getattr(torch, dev.type, None), "device_count", None)
    n = _call(count) if callable(count) else None
    if dev.index is not None and isinstance(n, int) and dev.index >= n:
        raise UsageError(f"--device {spec!r}: this machine has {n} {dev.type} device{'s' if n != 1 else ''}"
                         + (f" ({dev.type}:0 to {dev.type}:{n - 1})" if n else ""))
    return dev


def _available(kind: str) -> bool:
    """Whether torch can run on a device of this type here (False for every type torch has no backend for)."""
    if kind == "mps":
        return bool(_call(torch.backends.mps.is_available))
    check = getattr(getattr(torch, kind, None), "is_available", None)
    return callable(check) and bool(_call(check))


def _call(fn: Callable) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a backend that cannot even say is as good as absent
        return None


def eager_subject(snap: Snapshot, model: nn.Module, how: str, loss_fn: Callable | None, loss_name: str | None,
                  device: torch.device, **extra: Any) -> Subject:
    """A Subject that runs `model`, with the snapshot's state loaded, on the snapshot's batch."""
    if snap.state is not None:
        load_state(model, snap.state)
    model.to(device)
    extra.setdefault("input_names", forward_parameter_names(model))
    return Subject(model=model, inputs=to_device(snap.inputs, device), target=to_device(snap.target, device),
                   loss_fn=loss_fn, loss_name=loss_name, how=how, device=device, **extra)


