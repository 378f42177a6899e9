"""Source lines: which frame is the user's, and how a recorded frame is shown.

A frame is `(file, line, function, code-or-None)`.
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
from typing import Any

import torch

Frame = tuple  # (file, line, function, code-or-None)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the nanreplay package
_STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"] + os.sep, os.path.dirname(os.__file__) + os.sep})
_USER, _SKIP, _STOP = 0, 1, 2
_frame_kind: dict[Any, int] = {}


def _classify(filename: str) -> int:
    if filename.startswith(_OWN_DIR):
        return _STOP  # nanreplay's own driver code: there is no user line above this
    if filename.startswith(_TORCH_DIR) or filename.startswith(_STDLIB_DIRS):
        return _SKIP
    if filename.startswith(("<frozen", "<eval_with_key")) or "site-packages/torch/" in filename:
        return _SKIP
    return _USER


def user_frame(depth: int = 2) -> Frame | None:
    """The innermost frame outside torch and the stdlib: the user's line."""
    f = sys._getframe(depth)
    kinds = _frame_kind
    while f is not None:
        code = f.f_code
        k = kinds.get(code)
        if k is None:
            k = kinds[code] = _classify(code.co_filename)
        if k == _USER:
            return (code.co_filename, f.f_lineno, code.co_name, None)
        if k == _STOP:
            return None
        f = f.f_back
    return None


@functools.lru_cache(maxsize=256)
def local_copy(path: str) -> str:
    """The file here that a path recorded on another machine (or checkout) most likely refers to.

    A snapshot from /home/alice/proj/pkg/model.py analyzed in a checkout of proj finds
    ./pkg/model.py: the longest tail of the recorded path that exists below the current
    folder. Where the recorded path itself exists (another checkout on this machine), a
    local file must share at least its folder and name to be preferred. Falls back to
    the recorded path.
    """
    if not os.path.isabs(path):
        return path
    try:
        if not os.path.relpath(path).startswith(".."):
            return path  # already below the current folder
    except ValueError:
        pass
    parts = path.replace("\\", "/").split("/")
    shortest = 2 if os.path.exists(path) else 1
    for k in range(min(len(parts) - 1, 6), shortest - 1, -1):
        cand = os.path.join(*parts[-k:])
        if os.path.isfile(cand):
            return cand
    return path


def frame_json(frame: Frame | None) -> dict | None:
    if frame is None:
        return None
    recorded, line, func, code = frame
    file = local_copy(recorded)
    if file != recorded and code is not None and linecache.getline(file, line).strip() != code.strip():
        file = recorded  # the local copy has changed at that line: it is not the code that ran
    if code is None:
        code = linecache.getline(file, line).strip() or None
    shown = file
    try:
        rel = os.path.relpath(file)
        if not rel.startswith(".."):
            shown = rel
    except ValueError:
        pass
    out = {"file": shown, "line": line, "code": code, "function": func, "path": file}
    if file != recorded:
        out["recorded_path"] = recorded
    return out


