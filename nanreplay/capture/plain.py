"""Plain data: every non-tensor value a guard-written snapshot holds, so that it loads with
`torch.load(weights_only=True)` and never needs a pickled Python object (nor numpy).

Training code keeps values in the optimizer's param_groups, the scheduler, the GradScaler, a loss's
arguments and the batch that are not plain Python: numpy scalars (a `LambdaLR` whose lambda returns
`np.cos(...)` puts `numpy.float64` learning rates into every param group), numpy arrays, `Fraction`,
`Decimal`, enums, dataclasses. `data()` turns them into JSON values or CPU tensors at capture time:

* numpy scalars -> Python numbers (`.item()`); numpy arrays -> tensors (object arrays -> lists);
* subclasses of bool/int/float/str (`numpy.float64`, `numpy.str_`, an `IntEnum`) -> the plain type;
* `Fraction`, `Decimal` and other real numbers -> float; an `Enum` -> its value; a dataclass -> a dict;
* `torch.dtype` / `torch.device` -> their names; dict keys -> str (ints stay ints); tuples -> lists
  (unless `keep_tuples`: a batch's tuple means `model(*x)`);
* anything else is not data: `unknown(x)` decides (by default its repr, cut to 200 characters).

This module imports only torch (numpy is recognised by its type's module, never imported).
"""

from __future__ import annotations

import dataclasses
import decimal
import enum
import fractions
import numbers
from collections.abc import Callable
from typing import Any

import torch

MAX_DEPTH = 64


class NotData(ValueError):
    """Raised by `refuse`: a value that has no plain-data form."""


def refuse(x: Any) -> Any:
    raise NotData(f"{type(x).__module__}.{type(x).__qualname__}")


def _repr(x: Any) -> str:
    try:
        return repr(x)[:200]
    except Exception:  # noqa: BLE001 - a repr that raises is still not data
        return f"<{type(x).__qualname__}>"[:200]


def is_numpy(x: Any) -> bool:
    return (type(x).__module__ or "").split(".")[0] == "numpy"


def data(x: Any, *, keep_tuples: bool = False, unknown: Callable[[Any], Any] = _repr,
         tensor: Callable[[torch.Tensor], Any] | None = None, _depth: int = 0) -> Any:
    """`x` as JSON values and CPU tensors (see the module docstring). `tensor(t)` copies a tensor (default:
    a detached CPU copy)."""
    if _depth > MAX_DEPTH:
        return unknown(x)
    if isinstance(x, torch.Tensor):
        if x.layout is not torch.strided:  # (SGD's momentum for a sparse gradient): a snapshot holds dense tensors
            x = x.detach().to_dense()
        return tensor(x) if tensor is not None else x.detach().to("cpu", copy=True)
    if x is None or type(x) in (bool, int, float, str):
        return x

    def rec(v: Any) -> Any:
        return data(v, keep_tuples=keep_tuples, unknown=unknown, tensor=tensor, _depth=_depth + 1)

    if isinstance(x, enum.Enum):
        return rec(x.value)
    if isinstance(x, bool):
        return bool(x)
    if isinstance(x, numbers.Integral) and not is_numpy(x):
        return int(x)
    if isinstance(x, str):
        return str(x)
    if isinstance(x, float):
        return float(x)
    if is_numpy(x):
        return _numpy(x, rec, unknown)
    if isinstance(x, (fractions.Fraction, decimal.Decimal)) or (isinstance(x, numbers.Real)):
        try:
            return float(x)
        except (TypeError, ValueError, OverflowError, decimal.InvalidOperation):
            return unknown(x)
    if isinstance(x, dict):
        return {_key(k): rec(v) for k, v in x.items()}
    if isinstance(x, tuple) and keep_tuples and type(x) is tuple:
        return tuple(rec(v) for v in x)
    if isinstance(x, (list, tuple)):
        return [rec(v) for v in x]
    if isinstance(x, (torch.dtype, torch.device)):
        return str(x).removeprefix("torch.")
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: rec(getattr(x, f.name, None)) for f in dataclasses.fields(x)}
    return unknown(x)


def _numpy(x: Any, rec: Callable, unknown: Callable) -> Any:
    shape = getattr(x, "shape", None)
    if shape is not None and hasattr(x, "dtype") and hasattr(x, "tolist"):
        if shape == () and hasattr(x, "item"):
            return rec(x.item())
        if getattr(x.dtype, "kind", "O") in "biuf":
            try:
                return torch.tensor(x.tolist(), dtype=_torch_dtype(x.dtype)) if x.size else \
                    torch.zeros(tuple(shape), dtype=_torch_dtype(x.dtype))
            except (TypeError, ValueError, RuntimeError):
                pass
        return rec(x.tolist())
    if hasattr(x, "item"):
        try:
            return rec(x.item())
        except (TypeError, ValueError):
            pass
    return unknown(x)


_NP_TO_TORCH = {"bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
                "int32": torch.int32, "int64": torch.int64, "float16": torch.float16, "float32": torch.float32,
                "float64": torch.float64, "uint16": torch.int32, "uint32": torch.int64}


def _torch_dtype(dt: Any) -> torch.dtype | None:
    return _NP_TO_TORCH.get(str(dt))


MAX_KEY_ITEMS = 8  # a tuple key's items (torch_geometric's edge types have three)


def batch_key(k: Any) -> str | int | tuple:
    """A batch dict's key as a snapshot holds it: strings and ints as they are, a short tuple of them as a tuple
    (torch_geometric's `edge_index_dict` is keyed by `(src, relation, dst)`), anything else as `_key` spells it.
    The step program names batch tensors by the same keys."""
    if isinstance(k, tuple) and type(k) is tuple and 0 < len(k) <= MAX_KEY_ITEMS and \
            all(type(x) in (str, int) for x in k):
        return k
    return _key(k)


def _key(k: Any) -> str | int:
    if type(k) in (str, int):
        return k
    if isinstance(k, bool) or not isinstance(k, (numbers.Integral, str)):
        return str(k)
    return int(k) if isinstance(k, numbers.Integral) else str(k)
