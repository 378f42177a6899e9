"""Walking nested batches (tensors inside dicts, lists and tuples) without torch's private pytree."""

from __future__ import annotations

from typing import Any

import torch


def iter_tensors(obj: Any, prefix: str = ""):
    """Yield (name, tensor) for every tensor in a nested batch structure."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}[{i}]")


def map_tensors(obj: Any, fn):
    """Apply fn to every tensor in a nested batch structure, keeping its shape."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    return obj
