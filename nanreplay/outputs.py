"""Output paths the user names (`-o`, `--json`): checked before any work, so nothing but a regular file is written.

    output_path(path, inputs=[snapshot]) -> None for stdout, else the path to write atomically

`-` and the stdout device paths (/dev/stdout, /dev/fd/1, /proc/self/fd/1) mean stdout.
Any other existing path must be a regular file — never a symlink, a device node (not even
/dev/null, whoever runs the command), a FIFO, a socket or a folder — and never one of the
inputs. The write itself (`atomic.write_with`) checks again just before the rename.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from nanreplay.atomic import special_kind
from nanreplay.errors import OutputError

STDOUT_NAMES = frozenset({"-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"})


def is_stdout(path: str | None) -> bool:
    return path is not None and str(path) in STDOUT_NAMES


def output_path(path: str, *, inputs: Iterable[str] = (), option: str = "-o") -> str | None:
    """`path` checked as an output file: None means stdout. Raises OutputError (exit 2) with one line."""
    if is_stdout(path):
        return None
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{option} {path}: cannot use it as an output: {e.strerror or e}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{option} {path}: is a directory; give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(f"{option} {path}: is {special_kind(st.st_mode)}; nanreplay writes only regular "
                              "files (use '-' for stdout)")
        for inp in inputs:
            try:
                if os.path.samefile(p, inp):
                    raise OutputError(f"{option} {path}: refusing to overwrite the snapshot itself with a report")
            except OSError:
                continue
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{option} {path}: folder {str(parent)!r} does not exist")
    return str(p)


def distinct(*named: tuple[str, str | None]) -> None:
    """At most one output may go to stdout, and no two to the same file: `(option, resolved)` pairs."""
    to_stdout = [opt for opt, path in named if path is None]
    if len(to_stdout) > 1:
        raise OutputError(f"{' and '.join(to_stdout)} both write to stdout; send one of them to a file")
    seen: dict[str, str] = {}
    for opt, path in named:
        if path is None:
            continue
        key = os.path.normcase(os.path.abspath(path))
        if key in seen:
            raise OutputError(f"{seen[key]} and {opt} name the same file {path!r}; give each its own")
        seen[key] = opt
