"""Plain state-dict snapshots: the dict the "cheap NaN insurance" snippet writes.

    torch.save({'x': x, 'y': y, 'state': model.state_dict()}, path)

It holds only weights and a batch, so the model comes from `--model` (or, with
`--trust`, a pickled module in the file) and the loss from `--loss`. Common variants
are recognised: `inputs`/`targets`/`model_state_dict`, `batch` as `(x, y)` or a dict,
`state_dict`, DDP's `module.` prefix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from nanreplay.errors import ModelError, SnapshotError
from nanreplay.formats.base import Format, Snapshot
from nanreplay.formats.rebuild import eager_subject, parse_device
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
    return eager_subject(snap, m, how, resolve_loss(loss) if loss else None, loss, dev,
                         input_label=snap.keys.get("inputs", "inputs"),
                         target_label=snap.keys.get("target", "target"))



def describe(snap: Snapshot) -> dict:
    return {}


STATE_DICT = Format("state_dict", "plain state-dict snapshot", sniff, parse, rebuild, describe)
