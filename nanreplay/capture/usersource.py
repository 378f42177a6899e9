"""The user's source files, read and parsed for one snapshot write (construct.py, sites.py).

Two capture records need the user's code as syntax: where an `nn.Sequential` was built (construct.py) and where
the optimizer, scheduler, autocast and rate writes were made (sites.py, with ratesource.py and lrwrites.py as its
matching rules). Both run only when a snapshot is written. This module owns what they share:

* which files: the user's frames on the call stack, the files of the model's own classes, never torch's, the
  standard library's, an installed package's (site-packages / dist-packages) or nanreplay's own (`is_user`);
* the limits: a file over MAX_FILE_BYTES on disk is not read;
* reading (linecache: the text the running code came from) and `ast.parse`, once per file per snapshot: a
  `Sources` is made for one snapshot write and passed to each reader, so a file both read is parsed once.

Nothing here runs user code, and no method raises (a file that cannot be read or parsed is None).
This module imports only torch and the standard library.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import sys
import sysconfig
from typing import Any

import torch

MAX_FILE_BYTES = 2_000_000
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIB_DIRS = tuple({p + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")
                   if (p := sysconfig.get_paths().get(k))} | {os.path.dirname(os.__file__) + os.sep})


def readable(path: str) -> bool:
    """A .py file that exists and is no larger than MAX_FILE_BYTES."""
    try:
        return path.endswith(".py") and os.path.isfile(path) and os.path.getsize(path) <= MAX_FILE_BYTES
    except OSError:
        return False


def is_user(path: str) -> bool:
    """A .py file of the user's: not torch's, the standard library's, an installed package's or nanreplay's."""
    if not path.endswith(".py") or not os.path.isfile(path):
        return False
    if path.startswith((_TORCH_DIR, _OWN_DIR)) or path.startswith(_LIB_DIRS):
        return False
    return "site-packages" not in path and "dist-packages" not in path


def stack_files(depth: int, limit: int) -> list[str]:
    """The user's files of the frames on the stack above the caller's `depth`-th frame, innermost first."""
    out: list[str] = []
    f = sys._getframe(depth + 1)
    while f is not None and len(out) < limit:
        p = f.f_code.co_filename
        if p not in out and is_user(p):
            out.append(p)
        f = f.f_back
    return out


def model_class_files(model: Any, out: list[str], limit: int) -> list[str]:
    """`out` with the user's files of the model's class and its first two bases added (a class's file from its
    own functions: its module may not be registered), up to `limit` files in all."""
    for cls in type(model).__mro__[:3]:
        codes = [getattr(f, "__code__", None) for f in vars(cls).values()]
        p = next((c.co_filename for c in codes if c is not None), None)
        if p and p not in out and is_user(p) and len(out) < limit:
            out.append(p)
    return out


def module_class_files(model: Any) -> list[str]:
    """The source files of the classes of all the model's modules that are not torch's."""
    out: list[str] = []
    for m in model.modules():
        cls = type(m)
        if cls.__module__.split(".")[0] == "torch":
            continue
        try:
            out.append(inspect.getsourcefile(cls) or "")
        except (TypeError, OSError):
            continue
    return out


class Sources:
    """The user's files as read for one snapshot write: each read and parsed at most once."""

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[list[str], ast.Module] | None] = {}

    def parse(self, path: str) -> tuple[list[str], ast.Module] | None:
        """(lines, tree) of a readable file, or None: missing, too large, empty, or not valid Python."""
        if path not in self._parsed:
            self._parsed[path] = self._read(path)
        return self._parsed[path]

    @staticmethod
    def _read(path: str) -> tuple[list[str], ast.Module] | None:
        if not readable(path):
            return None
        try:
            lines = linecache.getlines(path)
            return (lines, ast.parse("".join(lines))) if lines else None
        except (SyntaxError, ValueError, RecursionError, MemoryError, OSError, UnicodeDecodeError):
            return None
