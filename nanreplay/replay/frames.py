"""Source lines: which frame is the user's, and how a recorded frame is shown.

A frame is `(file, line, function, code-or-None)`.
"""

from __future__ import annotations

import contextvars
import linecache
import os
import stat
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


def skip_frames_of(*functions) -> None:
    """Frames of these functions (nanreplay's own modes) sit between the user's line and an op: look
    through them. torch may wrap a mode's method (e.g. to disable dynamo); its inner function counts too."""
    for fn in functions:
        seen = 0
        while fn is not None and seen < 5:
            code = getattr(fn, "__code__", None)
            if code is not None:
                _frame_kind[code] = _SKIP
            fn = getattr(fn, "__wrapped__", None)
            seen += 1


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


def user_frames_from(f, count: int) -> list[Frame]:
    """Up to `count` user frames (outside torch and the stdlib) from frame `f` outward, each a different
    function's, with its line's code; stops at nanreplay's own code."""
    out: list[Frame] = []
    while f is not None and len(out) < count:
        code = f.f_code
        k = _frame_kind.get(code)
        if k is None:
            k = _frame_kind[code] = _classify(code.co_filename)
        if k == _STOP:
            break
        if k == _USER:
            out.append((code.co_filename, f.f_lineno, code.co_name,
                        linecache.getline(code.co_filename, f.f_lineno).strip()[:2000] or None))
        f = f.f_back
    return out


# Folders whose .py files may be read to show or rewrite a line a *snapshot* recorded (not lines of code that
# ran in this process, which are read as usual). Set by the analysis from `--source DIR` only (default: none —
# a guessable line such as `DEBUG = False` is no proof that a file under the current folder is the one recorded).
SOURCE_ROOTS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("nanreplay_source_roots", default=())
CONTEXT = 4  # lines shown above and below a line, for frames of code that ran here
MAX_SOURCE_BYTES = 2_000_000


class RecordedFrame(tuple):
    """A frame recorded at capture time — (file, line, function, code) — with its context lines.

    Its text comes from the snapshot. A local file is consulted only where `local_source` allows it.
    """

    context: tuple[int, list[str]] | None

    def __new__(cls, file: str, line: int, function: str, code: str | None,
                context: tuple[int, list[str]] | None = None):
        obj = super().__new__(cls, (file, line, function, code))
        obj.context = context
        return obj

    def __getnewargs__(self):
        return (*tuple(self), self.context)


def local_source(recorded: str, line: int, code: str | None) -> str | None:
    """The local file that may stand for a recorded one: a `.py` regular file under an allowed folder whose
    line `line` is exactly the recorded code. Never used to fill a line the snapshot left empty."""
    if not code or not recorded.endswith(".py"):
        return None
    for root in SOURCE_ROOTS.get():
        found = _match_under(os.path.realpath(root), recorded, line, code.strip())
        if found:
            return found
    return None


def only_recorded(line: int, code: str | None) -> dict | None:
    """The context of a recorded frame that recorded none: its one recorded line."""
    return {"start": line, "lines": [code]} if isinstance(code, str) and isinstance(line, int) and line >= 1 else None


MAX_SOURCE_FILES = 20_000  # .py files of the --source folders a confined child may open


def python_files_under(roots: list[str]) -> list[str]:
    """The regular .py files (of sane size) under `roots`, resolved and inside their root: all a confined child
    may open of the --source folders (its Landlock rules name these files, not the folders: no `.env`, no data)."""
    out: list[str] = []
    for root in roots:
        top = os.path.realpath(root)
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for f in files:
                if not f.endswith(".py"):
                    continue
                real = os.path.realpath(os.path.join(folder, f))
                try:
                    st = os.stat(real)
                except OSError:
                    continue
                if real.startswith(top + os.sep) and stat.S_ISREG(st.st_mode) and st.st_size <= MAX_SOURCE_BYTES:
                    out.append(real)
                    if len(out) >= MAX_SOURCE_FILES:
                        return out
    return out


def _match_under(root: str, recorded: str, line: int, code: str) -> str | None:
    parts = [p for p in recorded.replace("\\", "/").split("/") if p not in ("", ".", "..")]
    for k in range(min(len(parts), 8), 0, -1):  # the longest tail of the recorded path that exists here
        cand = os.path.join(root, *parts[-k:])
        real = os.path.realpath(cand)
        if not real.startswith(root + os.sep) or not real.endswith(".py"):
            continue  # never through a link out of the folder, never to a file that is not Python source
        try:
            st = os.stat(real)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
            continue
        if linecache.getline(real, line).strip() == code:
            return real
    return None


# Paths are shown relative to the folder the user ran nanreplay in: a confined child runs in an empty folder of its
# own, and is told the user's (show_relative_to); a pure string operation, nothing is read there.
_SHOWN_FROM: str | None = None


def show_relative_to(folder: str | None) -> None:
    global _SHOWN_FROM
    _SHOWN_FROM = folder


def _shown(path: str) -> str:
    try:
        rel = os.path.relpath(path, _SHOWN_FROM or os.curdir)
        if not rel.startswith(".."):
            return rel
    except ValueError:
        pass
    return path


def _live_context(file: str, line: int) -> dict | None:
    lines = linecache.getlines(file)
    if not lines or line > len(lines):
        return None
    lo, hi = max(1, line - CONTEXT), min(len(lines), line + CONTEXT)
    return {"start": lo, "lines": [ln.rstrip("\n") for ln in lines[lo - 1:hi]]}


def frame_json(frame: Frame | None, context: bool = True) -> dict | None:
    """A frame as the analysis JSON shows it: file (as shown), line, code, function, path (a local file that
    may be read, or None), context ({start, lines} around the line; left out with context=False),
    recorded_path (where it was recorded). A snapshot's frame shows only lines the snapshot recorded: without
    recorded context, a local copy's line stands alone (a guessable `DEBUG = False` quotes none of its neighbours)."""
    if frame is None:
        return None
    if isinstance(frame, RecordedFrame):
        recorded, line, func, code = frame
        local = local_source(recorded, line, code)
        ctx = {"start": frame.context[0], "lines": list(frame.context[1])} if frame.context and context else None
        if local is not None and ctx is None and context:  # no line the snapshot did not record is shown: its own
            ctx = only_recorded(line, code)  # line stands for the context, never the local file's neighbours
        out = {"file": _shown(local) if local else recorded, "line": line, "code": code, "function": func,
               "path": local, "context": ctx}
        if local is not None and local != recorded:
            out["recorded_path"] = recorded
        return out
    file, line, func, code = frame  # code that ran in this process: its file is the real one
    if code is None:
        code = linecache.getline(file, line).strip() or None
    return {"file": _shown(file), "line": line, "code": code, "function": func, "path": file,
            "context": _live_context(file, line) if context else None}
