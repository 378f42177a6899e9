"""Reading a snapshot file safely: one `torch.load(weights_only=True)`, every failure one line.

Loading never runs code from the file. A file that needs more (a pickled module, a
custom class) is refused with a message that says how to opt in (`--trust`).
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

import torch

from nanreplay.errors import SnapshotError, TrustError, first_line

_ZIP_MAGIC = b"PK\x03\x04"
# torch.save's legacy (pre-1.6) format starts with a protocol-2 pickle of this magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."


def read_file(path: str | Path, *, trust: bool = False) -> Any:
    """torch.load a file safely, turning every failure into one clear line."""
    p = Path(path)
    try:
        st = p.stat()
        if stat.S_ISDIR(st.st_mode):
            raise SnapshotError(f"{path}: is a directory (use `nanreplay triage DIR` for a folder)")
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block, a device would never end
            raise SnapshotError(f"{path}: not a regular file (a device, FIFO or socket); a snapshot is a file")
        with p.open("rb") as f:
            head = f.read(len(_LEGACY_MAGIC))
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from None
    if not head:
        raise SnapshotError(f"{path}: empty file, not a snapshot")
    is_zip = head.startswith(_ZIP_MAGIC)
    if not is_zip and not head.startswith(_LEGACY_MAGIC):
        kind = "a plain pickle" if head[:1] == b"\x80" else "not a torch.save file"
        raise SnapshotError(f"{path}: not a snapshot ({kind}; expected a file written by torch.save)")
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=is_zip)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types; each becomes one line
        msg = str(e)
        if "Weights only load failed" not in msg:
            if "zip archive" in msg or isinstance(e, EOFError):
                why = first_line(msg) or "unexpected end of file"
                raise SnapshotError(f"{path}: corrupt or truncated snapshot ({why})") from None
            raise SnapshotError(f"{path}: cannot load snapshot: {type(e).__name__}: {first_line(msg)}") from None
        what = _needed_global(msg)
        if not trust:
            raise TrustError(
                f"{path}: refusing to load: the file contains pickled Python objects{what}, "
                "and loading them would run code from the snapshot. If you trust where it came from, "
                "re-run with --trust."
            ) from None
    try:
        return torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise SnapshotError(f"{path}: cannot load snapshot even with --trust: {type(e).__name__}: {first_line(e)}") from None


def _needed_global(msg: str) -> str:
    m = re.search(r"GLOBAL ([\w.]+)", msg)
    return f" (it references {m.group(1)})" if m else ""


