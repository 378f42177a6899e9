"""Reading snapshot files: the native format and the seed's ad-hoc dicts.

Loading never runs code from the file: everything goes through
`torch.load(weights_only=True)`. A file that needs more (a pickled module, a
custom class) is refused with a message that says how to opt in (`--trust`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanreplay.errors import TrustError, UsageError, first_line

# The native format. Bump VERSION on any incompatible change and say why here.
#   1 — first version.
FORMAT = "nanreplay.snapshot"
VERSION = 1

# Keys of the seed's "cheap NaN insurance" dict and its common variants.
INPUT_KEYS = ("x", "inputs", "input", "data", "features")
TARGET_KEYS = ("y", "targets", "target", "labels", "label")
STATE_KEYS = ("state", "model_state_dict", "state_dict", "model_state", "model")
BATCH_KEYS = ("batch",)

_ZIP_MAGIC = b"PK\x03\x04"
# torch.save's legacy (pre-1.6) format starts with a protocol-2 pickle of this magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."


@dataclass
class Snapshot:
    """A snapshot, normalised: what to feed the model and what state to load."""

    path: str
    format: str  # "seed" or "native"
    inputs: Any  # a tensor (model(x)), a tuple/list (model(*x)) or a dict (model(**x))
    target: Any = None
    state: dict[str, torch.Tensor] | None = None
    module: torch.nn.Module | None = None  # a pickled module (only ever with --trust)
    keys: dict[str, str] = field(default_factory=dict)  # which dict keys were used
    raw: dict = field(default_factory=dict)  # everything that was in the file
    step: int | None = None
    rank: int | None = None
    world_size: int | None = None
    trigger: str | None = None  # what made the guard write it: "loss" | "gradient" | "grad_spike"
    history: list[dict] = field(default_factory=list)  # recent steps: {"step", "loss", "grad_norm"}
    created: str | None = None  # ISO time the snapshot was written

    @property
    def name(self) -> str:
        return Path(self.path).name


def read_file(path: str | Path, *, trust: bool = False) -> Any:
    """torch.load a file safely, turning every failure into one clear line."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(len(_LEGACY_MAGIC))
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory (use `nanreplay triage DIR` for a folder)") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read: {e.strerror or e}") from None
    if not head:
        raise UsageError(f"{path}: empty file, not a snapshot")
    is_zip = head.startswith(_ZIP_MAGIC)
    if not is_zip and not head.startswith(_LEGACY_MAGIC):
        kind = "a plain pickle" if head[:1] == b"\x80" else "not a torch.save file"
        raise UsageError(f"{path}: not a snapshot ({kind}; expected a file written by torch.save)")
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=is_zip)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types; each becomes one line
        msg = str(e)
        if "Weights only load failed" not in msg:
            if "zip archive" in msg or isinstance(e, EOFError):
                why = first_line(msg) or "unexpected end of file"
                raise UsageError(f"{path}: corrupt or truncated snapshot ({why})") from None
            raise UsageError(f"{path}: cannot load snapshot: {type(e).__name__}: {first_line(msg)}") from None
        what = _needed_global(msg)
        if not trust:
            raise TrustError(
                f"{path}: refusing to load: the file contains pickled Python objects{what}, "
                "and loading them would run code from the snapshot. If you trust where it came from, "
                "re-run with --trust."
            ) from None
    try:
        return torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{path}: cannot load snapshot even with --trust: {type(e).__name__}: {first_line(e)}") from None


def _needed_global(msg: str) -> str:
    m = re.search(r"GLOBAL ([\w.]+)", msg)
    return f" (it references {m.group(1)})" if m else ""


def load(path: str | Path, *, trust: bool = False) -> Snapshot:
    """Read and normalise a snapshot file of any supported format."""
    obj = read_file(path, trust=trust)
    if not isinstance(obj, dict):
        raise UsageError(f"{path}: not a snapshot: the file holds a {type(obj).__name__}, expected a dict")
    if obj.get("format") == FORMAT:
        from nanreplay import native  # the native format lives with the capture side

        return native.from_dict(str(path), obj)
    return _from_seed_dict(str(path), obj)


def _pick(d: dict, names: tuple[str, ...]) -> str | None:
    return next((k for k in names if k in d), None)


def _from_seed_dict(path: str, d: dict) -> Snapshot:
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
        raise UsageError(
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
            raise UsageError(f"{path}: '{k_state}' holds a {type(val).__name__}, expected a state dict of tensors")
    step = d.get("step") if isinstance(d.get("step"), int) else _number_in_name(path, "step")
    rank = d.get("rank") if isinstance(d.get("rank"), int) else _number_in_name(path, "rank")
    return Snapshot(path=path, format="seed", inputs=inputs, target=target, state=state, module=module,
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
