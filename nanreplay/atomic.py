"""Atomic file writes: a temp file in the same folder, then a rename.

A reader never sees half a file, an existing file is replaced only by a complete
one, and a failed write leaves no debris behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_with(path: str | os.PathLike, write: Callable[[IO[bytes]], None], *, overwrite: bool = True) -> None:
    """Call `write(file)` on a temp file next to `path`, then move it into place.

    With overwrite=False an existing `path` is never replaced (FileExistsError).
    """
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent if str(p.parent) else ".")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the final file gets the usual permissions
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, p)
        else:
            os.link(tmp, p)  # fails if p exists: never clobbers another file
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike, text: str) -> None:
    write_with(path, lambda f: f.write(text.encode("utf-8")))
