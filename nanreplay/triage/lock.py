"""One triage at a time per OUTDIR: an advisory lock on a hidden file in it.

Two runs writing the same folder would delete or overwrite each other's reports and
leave an index that describes neither. The second one stops at once, with one line.
"""

from __future__ import annotations

import os
from pathlib import Path

from nanreplay.errors import UsageError

LOCK_FILE = ".nanreplay-lock"  # a leading dot: no snapshot's output name can start with one

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: no lock
    fcntl = None  # type: ignore[assignment]


class OutdirLock:
    """Held from planning to the last write; released by `release()` or when the process ends."""

    def __init__(self, outdir: Path):
        self.outdir = outdir
        self.fd: int | None = None

    def acquire(self) -> OutdirLock:
        if fcntl is None:  # pragma: no cover
            return self
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.outdir / LOCK_FILE, flags, 0o666)
        except OSError as e:
            raise UsageError(f"{self.outdir}: cannot lock the output folder: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_pid(fd)
            os.close(fd)
            raise UsageError(f"{self.outdir}: another nanreplay triage is writing to this folder"
                             f"{f' (pid {holder})' if holder else ''}; wait for it to finish or choose another -o"
                             ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None
