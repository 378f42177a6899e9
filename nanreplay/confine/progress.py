"""Which step-program node the confined child is running, kept where its parent can read it after a crash.

The child maps one small shared page (a memfd the parent made) and the two node loops — the dry run
and the replay — write the node about to run: `at(DRY_RUN, i, node.name, n)` (n: the program's node count).
A kernel that kills the process (SIGSEGV, SIGFPE) leaves the page as it was, and the parent names the op
and the node in its one line. While the child runs, the parent reads the same page for the terminal's
status line (`status`). Outside a confined child `at` is one global lookup and a return.
"""

from __future__ import annotations

import mmap
import struct

DRY_RUN, REPLAY, AFTER, LOAD = 1, 2, 3, 4  # AFTER: past the program's nodes (e.g. in backward)
PHASES = {DRY_RUN: "the dry run", REPLAY: "the replay", AFTER: "the replay (after the step program's nodes)",
          LOAD: "loading the snapshot"}
SIZE = 4096
_HEAD = struct.Struct("<qHH")  # node index, phase, length of the op name (then the name, UTF-8)
_TOTAL = struct.Struct("<q")  # at the page's end: the node count of the loop that wrote the node
_MAX_NAME = SIZE - _HEAD.size - _TOTAL.size

_page: mmap.mmap | None = None


def attach(fd: int) -> None:
    """In the child: write progress into the page of `fd` from now on."""
    global _page
    _page = mmap.mmap(fd, SIZE)


def detach() -> None:
    """Stop writing progress (an in-process analysis is over: cli.py)."""
    global _page
    page, _page = _page, None
    if page is not None:
        page.close()


def at(phase: int, node: int, name: str = "", total: int = 0) -> None:
    page = _page
    if page is None:
        return
    raw = name.encode("utf-8", "replace")[:_MAX_NAME]
    _HEAD.pack_into(page, 0, node, phase, len(raw))
    page[_HEAD.size:_HEAD.size + len(raw)] = raw
    _TOTAL.pack_into(page, SIZE - _TOTAL.size, total)


def status(fd: int) -> tuple[int, int, int] | None:
    """In the parent, while the child runs: (phase, node index, node count; 0 when unknown), or None before the
    child has written anything. Numbers only: the terminal shows no name the snapshot chose here."""
    with mmap.mmap(fd, SIZE, access=mmap.ACCESS_READ) as page:
        node, phase, _ = _HEAD.unpack_from(page, 0)
        (total,) = _TOTAL.unpack_from(page, SIZE - _TOTAL.size)
    return (phase, node, total) if phase in PHASES else None


def read(fd: int) -> tuple[str, int, str] | None:
    """In the parent: (phase, node index, op name) as the child last wrote it, or None."""
    with mmap.mmap(fd, SIZE, access=mmap.ACCESS_READ) as page:
        node, phase, n = _HEAD.unpack_from(page, 0)
        if phase not in PHASES:
            return None
        return PHASES[phase], node, bytes(page[_HEAD.size:_HEAD.size + min(n, _MAX_NAME)]).decode("utf-8", "replace")
