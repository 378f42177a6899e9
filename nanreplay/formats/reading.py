"""Reading a snapshot file safely: one `torch.load(weights_only=True)`, every failure one line.

Loading never runs code from the file. A file that needs more (a pickled module, a
custom class) is refused with a message that says how to opt in (`--trust`).

Loading never memory-maps the file: a file truncated while it is being analyzed
would kill the process with SIGBUS. Before torch.load sees a file, its size is checked:
only regular files, no bigger than the memory limit, and a zip archive whose entries
declare no more data than the file can hold (torch.save never compresses; a "zip bomb"
that would inflate to many times its size is refused).
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from nanreplay.errors import LimitError, SnapshotError, TrustError, first_line, first_sentences
from nanreplay.inputs import snapshot_file
from nanreplay.limits import format_size

# torch.save stores its entries uncompressed: what they declare fits in the file (plus this slack).
_ZIP_SLACK = 1 << 20


def read_file(path: str | Path, *, trust: bool = False, max_memory: int | None = None) -> Any:
    """torch.load a file safely, turning every failure into one clear line.

    `max_memory` (bytes): refuse a file whose data would need more (LimitError).
    """
    p = Path(path)
    st, is_zip = snapshot_file(p)
    check_size(path, st.st_size, is_zip=is_zip, max_memory=max_memory)
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True, mmap=False)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types; each becomes one line
        msg = str(e)
        if "Weights only load failed" not in msg:
            # the file was opened and its header read: an OSError from torch's reader (a seek past the end of a
            # cut-off zip) is the file's damage, not the disk's
            if "zip archive" in msg or isinstance(e, (EOFError, OSError)):
                why = first_sentences(msg, 120) or "unexpected end of file"
                raise SnapshotError(f"{path}: corrupt or truncated snapshot: the file is cut short or damaged "
                                    f"(torch.load: {why}); copy it again from where it was written") from None
            raise SnapshotError(f"{path}: cannot load snapshot: {type(e).__name__}: {first_line(msg)}") from None
        what = _needed_global(msg)
        if not what and _UNSUPPORTED_OPCODE.search(msg):  # no object in it: nothing --trust would make readable
            raise SnapshotError(f"{path}: corrupt or unsupported snapshot (its pickle uses an opcode torch.save "
                                "never writes)") from None
        if not trust:
            raise TrustError(
                f"{path}: refusing to load: the file contains pickled Python objects{what}, "
                "and loading them would run code from the snapshot. If you trust where it came from, "
                "re-run with --trust."
            ) from None
    else:
        check_tensors(obj, path, max_memory)
        return obj
    try:
        return torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise SnapshotError(f"{path}: cannot load snapshot even with --trust: {type(e).__name__}: {first_line(e)}") from None


def check_size(path: str | Path, size: int, *, is_zip: bool, max_memory: int | None) -> None:
    """Refuse a file that would need more memory than allowed, or a zip that declares more data than it holds."""
    limit = f"the memory limit of {format_size(max_memory)} (raise it with --max-memory)" if max_memory else ""
    if max_memory and size > max_memory:
        raise LimitError(f"{path}: the file is {format_size(size)}, more than {limit}")
    if not is_zip:
        return
    try:
        with zipfile.ZipFile(path) as z:
            declared = sum(max(0, i.file_size) for i in z.infolist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return  # torch.load will say what is wrong with it, in its words
    if declared > 2 * size + _ZIP_SLACK:
        raise SnapshotError(f"{path}: refusing to load: the archive declares {format_size(declared)} of data in a "
                            f"{format_size(size)} file (torch.save never compresses; a zip bomb?)")
    if max_memory and declared > max_memory:
        raise LimitError(f"{path}: the snapshot holds {format_size(declared)} of data, more than {limit}")


def check_tensors(obj: Any, path: str | Path, max_memory: int | None) -> None:
    """The tensors a file holds, at the size they take once copied (a replay clones its buffers and constants):
    a 1 KB storage viewed as 10**9 elements by a stride of 0 counts as 10**9 elements, before anything copies it."""
    storages: dict[int, int] = {}
    extra = 0
    stack = [(obj, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.device.type != "cpu":
                continue  # refused by the schema, with its own line
            if v.layout is not torch.strided:  # (no storage to measure; torch checks its indices only on request)
                raise SnapshotError(f"{path}: the snapshot holds a {str(v.layout).removeprefix('torch.')} tensor; "
                                    "a snapshot holds dense tensors only (a crafted or foreign file?)")
            held = v.untyped_storage().nbytes()
            storages[v.untyped_storage().data_ptr()] = held
            extra += max(0, v.numel() * v.element_size() - held)  # what a copy adds beyond the stored bytes
        elif depth < 16 and isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif depth < 16 and isinstance(v, (list, tuple)):
            stack.extend((x, depth + 1) for x in v)
    total = sum(storages.values()) + extra
    if max_memory and total > max_memory:
        raise LimitError(f"{path}: its tensors take {format_size(total)} once copied (sizes and strides, not the "
                         f"file's bytes), more than the memory limit of {format_size(max_memory)} (raise it with "
                         "--max-memory)")


# pickle opcodes that build no object (big integers: LONG, LONG1, LONG4) and that the weights-only reader refuses
_UNSUPPORTED_OPCODE = re.compile(r"Unsupported operand (76|138|139)\b")


def _needed_global(msg: str) -> str:
    m = re.search(r"GLOBAL ([\w.]+)", msg)
    return f" (it references {m.group(1)})" if m else ""


