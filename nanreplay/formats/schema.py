"""Small checkers for a loaded snapshot dict: every field's type and size, one line per violation.

A checker takes (value, where) and returns the value (possibly normalised) or raises
`SchemaError("where: what is wrong")`. Formats compose them into a table of fields.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch

from nanreplay.errors import SnapshotError

Checker = Callable[[Any, str], Any]

MAX_STR = 20_000  # longest string field kept (messages, names, code)
MAX_ITEMS = 1_000_000  # longest list / dict
MAX_DEPTH = 12  # deepest batch nesting
MAX_INT = 2**63  # the largest magnitude of an integer field that is not a count (int64, as torch stores them)
# dtypes a stored tensor may have: what the analysis can reduce and print (float8, quantized and bit types cannot)
STORED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                           torch.complex128, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                           torch.bool})
_SURROGATE = re.compile("[\ud800-\udfff]")


class SchemaError(Exception):
    pass


def _what(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {str(v.dtype).removeprefix('torch.')} tensor"
    return f"a {type(v).__name__}"


def format_version(d: dict, path: str, what: str, newest: int) -> int:
    """A snapshot's format version: an integer no newer than this nanreplay reads (else one clear line)."""
    v = d.get("version")
    if not isinstance(v, int) or isinstance(v, bool):
        raise SnapshotError(f"{path}: {what} without a version number")
    if v > newest:
        raise SnapshotError(f"{path}: {what} format version {v} is newer than this nanreplay understands "
                            f"({newest}); upgrade nanreplay")
    return v


def optional(check: Checker) -> Checker:
    def fn(v, where):
        return None if v is None else check(v, where)
    return fn


def string(limit: int = MAX_STR) -> Checker:
    def fn(v, where):
        if not isinstance(v, str):
            raise SchemaError(f"{where} must be a string, not {_what(v)}")
        if len(v) > limit:
            raise SchemaError(f"{where} is {len(v)} characters long (at most {limit})")
        if _SURROGATE.search(v):
            raise SchemaError(f"{where} is not valid Unicode (it holds a lone surrogate)")
        return v
    return fn


def integer(lo: int = -(2**62), hi: int = 2**62) -> Checker:
    def fn(v, where):
        if not isinstance(v, int) or isinstance(v, bool):
            raise SchemaError(f"{where} must be an integer, not {_what(v)}")
        if not lo <= v <= hi:
            shown = v if abs(v) < 10**30 else f"an integer of {_digits(v)} digits"
            raise SchemaError(f"{where} = {shown} is out of range [{lo}, {hi}]")
        return v
    return fn


def number(v: Any, where: str) -> float:
    """A real number; NaN and ±Inf are allowed (a non-finite loss is what snapshots are about); an integer
    beyond int64 is not a number any step recorded."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SchemaError(f"{where} must be a number, not {_what(v)}")
    if isinstance(v, int) and not -MAX_INT <= v <= MAX_INT:
        raise SchemaError(f"{where} is an integer of {_digits(v)} digits, not a number a step records")
    return float(v)


def finite_number(v: Any, where: str) -> float:
    x = number(v, where)
    if not math.isfinite(x):
        raise SchemaError(f"{where} must be finite")
    return x


def _digits(v: int) -> str:
    """How many digits an integer has, without printing it (str() of a huge int is slow, and refused by Python)."""
    return str(len(str(abs(v)))) if abs(v) < 10**4000 else "thousands of"


def boolean(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise SchemaError(f"{where} must be true or false, not {_what(v)}")
    return v


def one_of(*values: Any) -> Checker:
    def fn(v, where):
        if not isinstance(v, (str, int)) or isinstance(v, bool) or v not in values:
            simple = isinstance(v, (str, int)) and not isinstance(v, bool) and len(str(v)) < 40
            shown = repr(v) if simple else _what(v)
            raise SchemaError(f"{where} must be one of {', '.join(map(str, values))}, not {shown}")
        return v
    return fn


def tensor(dtypes: tuple[torch.dtype, ...] | None = None, max_dim: int = 16) -> Checker:
    def fn(v, where):
        if not isinstance(v, torch.Tensor):
            raise SchemaError(f"{where} must be a tensor, not {_what(v)}")
        if type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
            raise SchemaError(f"{where} is a tensor subclass ({type(v).__name__}), which a snapshot may not hold")
        if v.layout != torch.strided:
            raise SchemaError(f"{where} must be a dense tensor")
        if v.device.type != "cpu":
            raise SchemaError(f"{where} is a {v.device.type} tensor, which holds no data a snapshot can carry")
        if v.dtype not in STORED_DTYPES:
            raise SchemaError(f"{where} has dtype {str(v.dtype).removeprefix('torch.')}, which nanreplay cannot "
                              "analyze")
        if v.dim() > max_dim:
            raise SchemaError(f"{where} has {v.dim()} dimensions (at most {max_dim})")
        if dtypes is not None and v.dtype not in dtypes:
            raise SchemaError(f"{where} must have dtype {', '.join(str(d).removeprefix('torch.') for d in dtypes)}")
        return v
    return fn


def list_of(check: Checker, limit: int = MAX_ITEMS) -> Checker:
    def fn(v, where):
        if not isinstance(v, (list, tuple)):
            raise SchemaError(f"{where} must be a list, not {_what(v)}")
        if len(v) > limit:
            raise SchemaError(f"{where} has {len(v)} items (at most {limit})")
        return [check(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return fn


def dict_of(check: Checker, key: Checker | None = None, limit: int = MAX_ITEMS) -> Checker:
    key = key or string(1000)

    def fn(v, where):
        if not isinstance(v, dict):
            raise SchemaError(f"{where} must be a dict, not {_what(v)}")
        if len(v) > limit:
            raise SchemaError(f"{where} has {len(v)} entries (at most {limit})")
        return {key(k, f"{where} key"): check(x, f"{where}[{k!r}]" if isinstance(k, str) else f"{where} value")
                for k, x in v.items()}
    return fn


def record(fields: dict[str, Checker], *, required: tuple[str, ...] = (), extra: bool = True) -> Checker:
    """A dict with named fields (those present; a missing optional field stays missing); unknown keys are
    kept out (or refused with extra=False)."""
    def fn(v, where):
        if not isinstance(v, dict):
            raise SchemaError(f"{where} must be a dict, not {_what(v)}")
        missing = [k for k in required if k not in v]
        if missing:
            raise SchemaError(f"{where} is missing {', '.join(missing)}")
        if not extra:
            unknown = [k for k in v if k not in fields]
            if unknown:
                raise SchemaError(f"{where} has unknown field {str(unknown[0])[:40]!r}")
        return {k: check(v.get(k), f"{where}.{k}" if where else k) for k, check in fields.items() if k in v}
    return fn


def plain_value(v: Any, where: str, depth: int = 0) -> Any:
    """A value that may travel into JSON and reports: None, bool, int, finite-or-not float, short str,
    and lists / dicts of these."""
    if depth > MAX_DEPTH:
        raise SchemaError(f"{where} is nested too deeply")
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        return integer(-MAX_INT, MAX_INT)(v, where)
    if isinstance(v, float):
        return v
    if isinstance(v, str):
        return string()(v, where)
    if isinstance(v, (list, tuple)):
        return [plain_value(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(list_of(lambda x, w: x)(v, where))]
    if isinstance(v, dict):
        return {string(1000)(k, f"{where} key"): plain_value(x, f"{where}[{k!r}]", depth + 1)
                for k, x in dict_of(lambda x, w: x, key=lambda k, w: k)(v, where).items()}
    raise SchemaError(f"{where} holds {_what(v)}, which a snapshot field may not")


MAX_KEY_ITEMS = 8


def batch_key(k: Any, where: str) -> str | int | tuple:
    """A batch dict's key: a string, an int, or a short tuple of them (torch_geometric's edge types)."""
    if isinstance(k, int) and not isinstance(k, bool):
        return k
    if isinstance(k, tuple) and 0 < len(k) <= MAX_KEY_ITEMS:
        return tuple(x if isinstance(x, int) and not isinstance(x, bool) else string(1000)(x, where) for x in k)
    return string(1000)(k, where)


def batch_tree(v: Any, where: str, depth: int = 0) -> Any:
    """A batch: tensors and plain values in dicts, lists and tuples (structure kept)."""
    if depth > MAX_DEPTH:
        raise SchemaError(f"{where} is nested too deeply")
    if isinstance(v, torch.Tensor):
        return tensor()(v, where)
    if isinstance(v, tuple):
        return tuple(batch_tree(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
    if isinstance(v, list):
        if len(v) > MAX_ITEMS:
            raise SchemaError(f"{where} has too many items")
        return [batch_tree(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        return {batch_key(k, f"{where} key"): batch_tree(x, f"{where}[{k!r}]", depth + 1) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return plain_value(v, where, depth)
    raise SchemaError(f"{where} holds {_what(v)}, which a batch may not")
