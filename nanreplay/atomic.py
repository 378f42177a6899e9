"""Atomic file writes: a temp file in the same folder, then a rename.

A reader never sees half a file, an existing file is replaced only by a complete
one, and a failed write leaves no debris behind. Only regular files are ever
replaced: a symlink, a device node (/dev/null), a FIFO or a socket at the
destination is refused (SpecialFileError), whoever runs the command.

The temp file is created with mode 0o666 and the kernel applies the process's
umask, as for any new file: the umask is never read or changed here (`os.umask`
sets it process-wide, and other threads' files would get the wrong mode meanwhile).
A process killed mid-write (kill -9) leaves its hidden temp file behind;
`clean_stale_temps` removes old ones.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from nanreplay import interrupt

TEMP_SUFFIX = ".tmp"
STALE_AFTER = 3600.0  # seconds: a temp file this old belongs to no live write


class SpecialFileError(OSError):
    """The destination exists and is not a regular file; it is never replaced."""


def check_replaceable(path: str | os.PathLike) -> None:
    """Raise SpecialFileError when `path` exists and is anything but a regular file (a symlink is refused too)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise SpecialFileError(errno.EEXIST, f"{special_kind(st.st_mode)}, not a regular file; refusing to replace it",
                               str(path))


def special_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, word in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return word
    return "a special file"


def _temp_file(folder: Path, name: str) -> tuple[int, str]:
    """A new hidden file `.<name>.<random>.tmp` in `folder`, opened for writing; its mode follows the umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = str(folder / f".{name[:200]}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temp file name", str(folder))


def write_with(path: str | os.PathLike, write: Callable[[IO[bytes]], None], *, overwrite: bool = True) -> None:
    """Call `write(file)` on a temp file next to `path`, then move it into place.

    With overwrite=False an existing `path` is never replaced (FileExistsError).
    A `path` that exists and is not a regular file is never replaced (SpecialFileError).
    """
    p = Path(path)
    if overwrite:
        check_replaceable(p)
    fd, tmp = _temp_file(p.parent if str(p.parent) else Path("."), p.name)
    with interrupt.cleanup(lambda: _unlink(tmp)):  # Ctrl-C ends the command without unwinding: see interrupt.py
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            if overwrite:
                check_replaceable(p)  # again: it may have changed while we wrote
                os.replace(tmp, p)
            else:
                os.link(tmp, p)  # fails if p exists: never clobbers another file
                os.unlink(tmp)
        except BaseException:
            _unlink(tmp)
            raise


def _unlink(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def write_text(path: str | os.PathLike, text: str) -> None:
    # a lone surrogate (a path of undecodable bytes, as Python spells it) is written as U+FFFD, never a traceback
    write_with(path, lambda f: f.write(text.encode("utf-8", "replace")))


def write_texts(items: list[tuple[str | os.PathLike, str]]) -> None:
    """Write several files as one set (a report and its JSON): each is written to its own temp file first, and
    only once every one is complete are they moved into place. A write that fails (a full disk, a read-only
    folder) leaves no new file of the set and no temp file. Raises OSError whose `filename` is the output that
    could not be written; a destination that is not a regular file is refused as in `write_with`."""
    staged: list[tuple[str, Path]] = []

    def discard() -> None:
        for tmp, _ in staged:
            _unlink(tmp)

    with interrupt.cleanup(discard):
        try:
            for path, text in items:
                p = Path(path)
                try:
                    check_replaceable(p)
                    fd, tmp = _temp_file(p.parent if str(p.parent) else Path("."), p.name)
                    staged.append((tmp, p))
                    with os.fdopen(fd, "wb") as f:
                        f.write(text.encode("utf-8", "replace"))
                        f.flush()
                        os.fsync(f.fileno())
                except OSError as e:
                    raise OSError(e.errno, e.strerror or str(e), str(p)) from None
            for tmp, p in staged:
                check_replaceable(p)  # again: it may have changed while we wrote
                os.replace(tmp, p)
        finally:
            discard()  # (the ones moved into place are gone already)


def clean_stale_temps(folder: str | os.PathLike, prefix: str, *, older_than: float = STALE_AFTER) -> list[str]:
    """Remove this module's temp files `.<prefix>*.tmp` in `folder` older than `older_than` seconds.

    They are what a write killed midway (kill -9, power loss) left behind. Never raises;
    returns the names removed. Only regular files are touched.
    """
    removed: list[str] = []
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        if not (e.name.startswith(f".{prefix}") and e.name.endswith(TEMP_SUFFIX)):
            continue
        try:
            if e.is_file(follow_symlinks=False) and now - e.stat(follow_symlinks=False).st_mtime > older_than:
                os.unlink(e.path)
                removed.append(e.name)
        except OSError:
            continue
    return removed
