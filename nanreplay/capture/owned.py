"""The state a re-run of the step runs on: the guard's own, never the training's.

The guard runs the user's step again — the first step's loss check, recording a failing step, the micro-batch
search, the machine record — often between the user's forward and backward, while the user's graph still holds
tensors it saved for backward. Writing into any live tensor then (even a `copy_` of the very value it holds) bumps
its version counter, and the user's `backward()` dies with "one of the variables needed for gradient computation
has been modified by an inplace operation". So a re-run never writes into a live tensor:

* every registered buffer is swapped, in its module's `_buffers`, for a clone (of its value as the step began,
  where `begin()` kept one; else of its live value); the original tensor objects are put back afterwards, never
  written, their version counters untouched. Aliases (one tensor registered twice, a plain attribute naming a
  buffer) stay aliases of one clone;
* a tensor kept as a plain module attribute (not a buffer) is swapped for a clone the same way: a forward that
  mutates it in place writes into the clone. Its value as the step began is not known (only buffers are kept by
  `begin()`), so such a re-run starts from its value after the training step's forward; the training's tensor is
  left exactly as it was either way;
* parameters are the live ones (forward reads them); where an update snapshot records the step with the weights
  before the update, `weights_swapped` puts new Parameters in their place and the originals back after;
* every parameter's `.grad` slot is emptied for the re-run and the user's gradient objects put back after, so
  anything the re-run accumulates lands in fresh tensors;
* torch's CPU and CUDA generators, Python's `random` and numpy's global generator are set to the step's begin()
  state for the re-run and to their live state after;
* a module's own plain Python attributes — numbers, strings, None, tuples of them (a forward-call counter
  `self.calls += 1`, a curriculum's `self.step`), and the contents of its lists and dicts (`self.maps.append`)
  — are put back as they were, and plain attributes the re-run created are removed: a forward that counts its
  calls is not one call ahead after a spike snapshot or a re-run on which training goes on. (Objects the forward
  reaches outside the modules, and what lies inside a list's elements, are not restored.)

This module imports only torch.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn


def host_rng() -> dict:
    """The host-side generators a model's own code may draw from (Python's `random`, numpy's global one,
    where the step's code imported numpy): wav2vec2's SpecAugment masks come from numpy, so a re-run that
    restores only torch's generator records a different step. Kept in memory only; never written."""
    np = sys.modules.get("numpy")
    return {"python": random.getstate(),
            "numpy": np.random.get_state() if np is not None and hasattr(np, "random") else None}


def set_host_rng(state: dict | None) -> None:
    if not state:
        return
    if state.get("python") is not None:
        random.setstate(state["python"])
    np = sys.modules.get("numpy")
    if state.get("numpy") is not None and np is not None:
        np.random.set_state(state["numpy"])


class _Swaps:
    """Dict entries replaced for a while; `undo()` puts the original objects back (last first)."""

    def __init__(self) -> None:
        self.done: list[tuple[dict, str, Any]] = []

    def put(self, d: dict, key: str, value: Any) -> None:
        self.done.append((d, key, d[key]))
        d[key] = value

    def undo(self) -> None:
        while self.done:
            d, key, old = self.done.pop()
            d[key] = old


def _clone(src: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor of `src`'s value the re-run may write; one computed with grad (weight_norm's `weight` attribute)
    keeps its graph to the parameters, so the re-run's gradients still reach them."""
    if src.grad_fn is not None:
        with torch.enable_grad():
            return src.clone()
    with torch.no_grad():
        t = src.detach().clone()
    if like.requires_grad and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_(True)
    return t


def _swap_weights(modules: list, weights: dict[str, torch.Tensor], swaps: _Swaps, memo: dict) -> None:
    for prefix, m in modules:
        for key, p in list(m._parameters.items()):
            w = weights.get(f"{prefix}.{key}" if prefix else key)
            if p is None or (id(p) not in memo and (w is None or w.shape != p.shape)):
                continue
            if id(p) not in memo:
                with torch.no_grad():
                    memo[id(p)] = nn.Parameter(w.detach().to(p.device, p.dtype, copy=True),
                                               requires_grad=p.requires_grad)
            swaps.put(m._parameters, key, memo[id(p)])


def _swap_state(model: nn.Module, begin: dict[str, torch.Tensor], swaps: _Swaps) -> None:
    memo: dict[int, torch.Tensor] = {}  # id(live tensor) -> its stand-in (aliases share one)
    modules = list(model.named_modules())
    for prefix, m in modules:
        for key, b in list(m._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = _clone(begin.get(f"{prefix}.{key}" if prefix else key, b), b)
            swaps.put(m._buffers, key, memo[id(b)])
    for _, m in modules:
        for key, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                if id(v) not in memo:
                    memo[id(v)] = _clone(v, v)
                swaps.put(m.__dict__, key, memo[id(v)])


_TORCH_OWN = frozenset(vars(nn.Module()))  # `_parameters`, `_buffers`, the hook dicts, `training`: torch's own
_SCALAR = (int, float, complex, bool, str, bytes, type(None))


def _plain_value(v: Any) -> bool:
    return isinstance(v, _SCALAR) or (type(v) is tuple and len(v) <= 64 and all(isinstance(x, _SCALAR) for x in v))


class _PythonState:
    """Each module's plain Python attributes as the re-run found them (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.kept: list[tuple[dict, str, Any, Any]] = []  # (module __dict__, key, object, shallow copy or None)
        self.keys: list[tuple[dict, frozenset]] = []
        for m in model.modules():
            d = m.__dict__
            self.keys.append((d, frozenset(d)))
            for k, v in d.items():
                if k in _TORCH_OWN:
                    continue
                if _plain_value(v):
                    self.kept.append((d, k, v, None))
                elif type(v) is list:
                    self.kept.append((d, k, v, list(v)))
                elif type(v) is dict:
                    self.kept.append((d, k, v, dict(v)))

    def restore(self) -> None:
        for d, before in self.keys:
            for k in [k for k in d if k not in before and k not in _TORCH_OWN]:
                if _plain_value(d[k]) or isinstance(d[k], (list, dict, torch.Tensor)):
                    del d[k]
        for d, k, v, copy in self.kept:
            if d.get(k, d) is not v:
                d[k] = v
            if type(v) is list and (len(v) != len(copy) or any(a is not b for a, b in zip(v, copy, strict=True))):
                v[:] = copy
            elif type(v) is dict and (v.keys() != copy.keys() or any(v[x] is not copy[x] for x in copy)):
                v.clear()
                v.update(copy)


def clone_tensors(obj: Any) -> Any:
    """`obj` (nested dicts, lists, tuples) with every tensor replaced by a clone the re-run may write (a forward
    that writes its inputs in place: FSMT's `shift_tokens_right` masks the labels with `masked_fill_`); anything
    else is kept as it is. One clone per tensor object (the same tensor in the batch and in the model call stays
    one tensor), and tensors that share a storage (inputs and shifted targets cut from one tensor) share one
    cloned span of it, so in-place writes alias as they did. A tensor whose storage does not hold it (one the
    step freed) is kept: reading it would read past its storage."""
    leaves = [t for t in _walk(obj) if isinstance(t, torch.Tensor)]
    memo: dict[int, torch.Tensor] = {}
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in leaves:
        if id(t) in memo or storage_freed(t):
            memo.setdefault(id(t), t)
            continue
        memo[id(t)] = t  # (placeholder: cloned below)
        try:
            groups.setdefault((t.untyped_storage().data_ptr(), t.dtype, t.device), []).append(t)
        except (RuntimeError, NotImplementedError):
            memo[id(t)] = _clone(t, t)
    for (ptr, _, _), ts in groups.items():
        if len(ts) < 2 or not ptr or any(t.requires_grad or type(t) is not torch.Tensor for t in ts):
            for t in ts:
                memo[id(t)] = _clone(t, t)
            continue
        lo = min(t.storage_offset() for t in ts)
        hi = max(storage_end(t) for t in ts)
        with torch.no_grad():
            flat = ts[0].detach().as_strided((hi - lo,), (1,), lo).clone()
        for t in ts:
            memo[id(t)] = flat.as_strided(t.size(), t.stride(), t.storage_offset() - lo)
    return _rebuild(obj, memo)


def _walk(x: Any, depth: int = 0):
    if depth > 32:
        return
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _walk(v, depth + 1)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _walk(v, depth + 1)


def _rebuild(x: Any, memo: dict, depth: int = 0) -> Any:
    if depth > 32:
        return x
    if isinstance(x, torch.Tensor):
        return memo.get(id(x), x)
    if type(x) is dict:
        return {k: _rebuild(v, memo, depth + 1) for k, v in x.items()}
    if type(x) is list:
        return [_rebuild(v, memo, depth + 1) for v in x]
    if type(x) is tuple:
        return tuple(_rebuild(v, memo, depth + 1) for v in x)
    return x  # other containers (a namedtuple, a BatchEncoding, a dataclass) as they are: their tensors live


def storage_end(t: torch.Tensor) -> int:
    """One past the last storage element `t` addresses."""
    return t.storage_offset() + sum((d - 1) * abs(st) for d, st in zip(t.shape, t.stride(), strict=True)) + 1 \
        if t.numel() else t.storage_offset()


def storage_freed(t: torch.Tensor) -> bool:
    """Whether `t`'s storage no longer holds the elements `t` addresses (freed or shrunk in place since it was made:
    PyG's GroupAddRev frees its input's storage): reading it would read past the storage."""
    if t.numel() == 0 or t.device.type == "meta":
        return False
    try:
        return t.untyped_storage().nbytes() < storage_end(t) * t.element_size()
    except (RuntimeError, NotImplementedError):
        return False


@contextlib.contextmanager
def rerun_state(model: nn.Module, rng: dict | None = None,
                begin: dict[str, torch.Tensor] | None = None) -> Iterator[None]:
    """Run the step again on state the guard owns (the module docstring): `rng` and `begin` (buffer name ->
    value as the step began) are what `begin()` kept; the training's tensors, gradients and generators are
    exactly as they were when this exits, whatever the re-run did."""
    rng = rng or {}
    live_rng, live_host = torch.get_rng_state(), host_rng()
    live_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    swaps = _Swaps()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    python = _PythonState(model)
    try:
        _swap_state(model, begin or {}, swaps)
        for m in model.modules():  # `max_norm` renormalises the weight in place (embedding_renorm_, a version bump
            # the loop's backward refuses when the weight is also saved, tied to the output); the loop's own forward
            # already renormalised every row this batch reads, so the re-run reads the same values without it
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
                swaps.put(m.__dict__, "max_norm", None)
        for p in params:
            p.grad = None
        if rng.get("cpu") is not None:
            torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") is not None:
            torch.cuda.set_rng_state_all(rng["cuda"])
        set_host_rng(rng.get("host"))
        yield
    finally:
        swaps.undo()
        python.restore()
        for p, g in zip(params, grads, strict=True):
            if p.grad is not g:
                p.grad = g
        torch.set_rng_state(live_rng)
        set_host_rng(live_host)
        if live_cuda is not None:
            torch.cuda.set_rng_state_all(live_cuda)


@contextlib.contextmanager
def weights_swapped(model: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """The module holds `weights` (name -> tensor) for the duration, as new Parameters swapped in; the original
    Parameter objects (the optimizer's keys, the user's references) are put back untouched."""
    swaps = _Swaps()
    try:
        _swap_weights(list(model.named_modules()), weights, swaps, {})
        yield
    finally:
        swaps.undo()
