"""Plain state-dict snapshots: the dict the "cheap NaN insurance" snippet writes.

    torch.save({'x': x, 'y': y, 'state': model.state_dict()}, path)

It holds only weights and a batch, so the model comes from `--model` (or, with
`--trust`, a pickled module in the file) and the loss from `--loss`. Common variants
are recognised: `inputs`/`targets`/`model_state_dict`, `batch` as `(x, y)` or a dict,
`state_dict`, DDP's `module.` prefix.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import torch

from nanreplay.errors import ModelError, SnapshotError
from nanreplay.formats.base import Format, Snapshot
from nanreplay.formats.rebuild import eager_subject, parse_device, state_misfit
from nanreplay.formats.usercode import build_model, resolve_loss
from nanreplay.replay.subject import Subject

# Keys of the plain dict and its common variants.
INPUT_KEYS = ("x", "inputs", "input", "data", "features")
TARGET_KEYS = ("y", "targets", "target", "labels", "label")
STATE_KEYS = ("state", "model_state_dict", "state_dict", "model_state", "model")
BATCH_KEYS = ("batch",)


def sniff(obj: dict) -> bool:
    return "format" not in obj


def _pick(d: dict, names: tuple[str, ...]) -> str | None:
    return next((k for k in names if k in d), None)


def parse(path: str, d: dict) -> Snapshot:
    keys: dict[str, str] = {}
    inputs = target = None
    k_in = _pick(d, INPUT_KEYS)
    k_batch = _pick(d, BATCH_KEYS)
    if k_in is not None:
        keys["inputs"], inputs = k_in, d[k_in]
        k_t = _pick(d, TARGET_KEYS)
        if k_t is not None:
            keys["target"], target = k_t, d[k_t]
    elif k_batch is not None:
        keys["inputs"] = k_batch
        inputs, target, k_t = _split_batch(d[k_batch])
        if k_t:
            keys["target"] = f"{k_batch}{k_t}"
    elif _is_bare_state_dict(d):
        raise SnapshotError(
            f"{path}: holds only a model's weights (a bare state_dict of {len(d)} tensors), not the batch that broke "
            "the step, and the replay needs both: write snapshots with nanreplay.NanGuard, or save a plain dict: "
            "torch.save({'x': x, 'y': y, 'state': model.state_dict()}, path)")
    else:
        raise SnapshotError(
            f"{path}: not a recognised snapshot: found keys {sorted(map(str, d))[:12]}; expected "
            f"one of {list(INPUT_KEYS + BATCH_KEYS)} for the batch (and a model state such as 'state')"
        )

    state = module = None
    k_state = _pick(d, STATE_KEYS)
    if k_state is not None:
        val = d[k_state]
        keys["state"] = k_state
        if isinstance(val, torch.nn.Module):
            module = val
        elif isinstance(val, dict) and all(isinstance(v, torch.Tensor) for v in val.values()):
            state = dict(val)
        else:
            raise SnapshotError(f"{path}: '{k_state}' holds a {type(val).__name__}, expected a state dict of tensors")
    step = d.get("step") if isinstance(d.get("step"), int) else _number_in_name(path, "step")
    rank = d.get("rank") if isinstance(d.get("rank"), int) else _number_in_name(path, "rank")
    return Snapshot(path=path, format="state_dict", inputs=inputs, target=target, state=state, module=module,
                    keys=keys, raw=d, step=step, rank=rank)


def _is_bare_state_dict(d: dict) -> bool:
    """`torch.save(model.state_dict(), path)`: only tensors, named like parameters (`fc.weight`, `bias`)."""
    return bool(d) and all(isinstance(v, torch.Tensor) for v in d.values()) and \
        any(isinstance(k, str) and ("." in k or k in ("weight", "bias")) for k in d)


def _split_batch(batch: Any) -> tuple[Any, Any, str | None]:
    """(inputs, target, how the target was found) from a `batch` value."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            return batch[0], batch[1], "[1]"
        if len(batch) == 1:
            return batch[0], None, None
        return tuple(batch), None, None
    if isinstance(batch, dict):
        k_in = _pick(batch, INPUT_KEYS)
        k_t = _pick(batch, TARGET_KEYS)
        if k_in is not None and set(batch) <= {k_in, k_t}:
            return batch[k_in], batch[k_t] if k_t else None, f"[{k_t!r}]" if k_t else None
        return batch, None, None  # keyword arguments for the model, e.g. a Hugging Face batch
    return batch, None, None


def _number_in_name(path: str, word: str) -> int | None:
    """`nan_snapshot_step_12_rank3.pt` -> 12 for "step", 3 for "rank"."""
    m = re.search(rf"{word}[_-]?(\d+)", Path(path).stem)
    return int(m.group(1)) if m else None


def rebuild(snap: Snapshot, *, model: str | None, loss: str | None, device: str | None,
            trust: bool, max_memory: int | None = None) -> Subject:
    """Rebuild a plain state-dict snapshot: the model comes from --model (or a trusted pickled module)."""
    dev = parse_device(device)
    if model is not None:
        m = build_model(model)
        how = f"--model {model}"
    elif snap.module is not None:  # only reachable with --trust: read_file refused otherwise
        m, how = snap.module, "pickled module in the snapshot (--trust)"
    else:
        raise ModelError(f"{snap.path}: a plain state-dict snapshot holds only weights; say which model they belong to "
                         "with --model MODULE:FACTORY (a zero-argument callable returning the nn.Module)")
    _check_arguments(snap, m)
    return eager_subject(snap, m, how, resolve_loss(loss) if loss else None, loss, dev,
                         input_label=snap.keys.get("inputs", "inputs"),
                         target_label=snap.keys.get("target", "target"))


def _check_arguments(snap: Snapshot, model: torch.nn.Module) -> None:
    """The batch must fill forward's parameters: a plain dict's `x` is passed as model(x), a tuple or list as
    model(*x), a dict as model(**x). One tensor for a two-argument forward is said here, with how to save it."""
    if isinstance(snap.inputs, dict):
        return
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in positional if p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    given = len(snap.inputs) if isinstance(snap.inputs, (tuple, list)) else 1
    if len(required) <= given and (varargs or given <= len(positional)):
        return
    misfit = state_misfit(model, snap.state) if isinstance(snap.state, dict) else ""
    if misfit:  # another model's snapshot: how to save the inputs is not the advice
        raise ModelError(f"{snap.path}: its weights are not {type(model).__name__}'s (the state dict does not fit it: "
                         f"{misfit}): it was saved from another model; name that model with --model MODULE:FACTORY")
    key = snap.keys.get("inputs", "x")
    if isinstance(snap.inputs, (tuple, list)):
        held = f"a {type(snap.inputs).__name__} of {given}, passed as model(*{key})"
    else:
        held = f"one tensor, passed as model({key})"
    names = ", ".join(p.name for p in positional)
    need = f"{len(required)} argument{'s' if len(required) != 1 else ''}"
    raise ModelError(f"{snap.path}: '{key}' holds {held}, but {type(model).__name__}.forward takes {need} ({names}); "
                     f"save one input per argument as a tuple or list, which is passed as model(*{key}): "
                     f"{{'{key}': ({names}), ...}}")


def describe(snap: Snapshot) -> dict:
    return {}


STATE_DICT = Format("state_dict", "plain state-dict snapshot", sniff, parse, rebuild, describe)
