"""Resource limits of an analysis: how much memory a snapshot may claim, and handing freed memory back between passes
(the time limit, `--timeout`, is interrupt.py's).

    parse_size("8G")         -> 8 * 2**30 (the `--max-memory SIZE` flag)
    default_max_memory()     -> a share of this machine's available memory

Light to import (no torch): triage's parent process uses it.
"""

from __future__ import annotations

import os
import re
import sys

DEFAULT_SHARE = 0.6  # of the memory available when the command starts
FALLBACK_MEMORY = 8 << 30  # where the machine cannot say what it has
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`8G`, `512M`, `1.5GiB`, `100000` (bytes) -> bytes. Units are binary (1K = 1024). ValueError when unreadable."""
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 8G, 512M, 1.5GiB)")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise ValueError(f"{text!r}: a size must be more than 0 bytes")
    return size


def format_size(n: int) -> str:
    """Bytes for people: `1.5 GiB`, `512 MiB`, `300 B`."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.3g} {unit}"
    return f"{n} B"


def available_memory() -> int | None:
    """Bytes this process could use now: the kernel's MemAvailable, lowered by a cgroup (container) limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            avail = None
    room = _cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail if avail and avail > 0 else None


def _cgroup_room() -> int | None:
    """cgroup v2: memory.max minus memory.current of this process's cgroup; None without a limit."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def default_max_memory(share: float = DEFAULT_SHARE) -> int:
    """The default `--max-memory`: `share` of the memory available now (8 GiB where that is unknown)."""
    avail = available_memory()
    return FALLBACK_MEMORY if avail is None else max(1 << 20, int(avail * share))


# The work a step program may ask of one replay, from the time the analysis may take: elements each node touches
# (expanded views at their full size) plus, for the matrix products, convolutions and attention, their
# multiply-adds. The rate is generous (a matrix product on a laptop's cores does 10**10..10**11 a second) so
# that a real step is never refused by it: the bound is for a crafted node that would run for years.
OPS_PER_SECOND = 5 * 10**10
DEFAULT_TIMEOUT = 600.0  # analyze's default --timeout (seconds), as triage's
_WORK: dict = {"budget": None}


def set_work_budget(timeout: float | None) -> None:
    """Bound the dry run's work estimate by what `timeout` seconds allow (None or 0: no bound)."""
    _WORK["budget"] = int(timeout * OPS_PER_SECOND) if timeout else None


def work_budget() -> int | None:
    return _WORK["budget"]


def release_memory() -> None:
    """Hand memory freed by one pass back to the system before the next (glibc keeps freed blocks otherwise,
    and each pass would then add its peak on top of the last one's). A no-op where there is no glibc."""
    trim = _malloc_trim()  # (no gc.collect(): tensors are freed by reference counting; a full collection costs more)
    if trim is not None:
        try:
            trim(0)
        except Exception:  # noqa: BLE001, S110 - an optimisation only
            pass


def _malloc_trim():
    if "_TRIM" not in globals():
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                fn = None
        globals()["_TRIM"] = fn
    return globals()["_TRIM"]
