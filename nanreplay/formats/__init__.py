"""Snapshot formats behind one small registry.

    snap = formats.load(path)                      # read + sniff + validate: no code runs
    subject = formats.rebuild(snap, model=..., loss=..., device=..., trust=...)

Each format is one module with a `Format` (see `formats/base.py`); adding a format is
one file plus one line in `FORMATS`. They are tried in order: the first whose `sniff`
says yes parses the file. A folder is a sharded snapshot: what its nanreplay.json holds is
sniffed the same way (`formats/sharded.py`).
"""

from __future__ import annotations

from pathlib import Path

from nanreplay.errors import SnapshotError
from nanreplay.formats import native, sharded, statedict
from nanreplay.formats.base import Format, Snapshot
from nanreplay.formats.reading import read_file

FORMATS: tuple[Format, ...] = (native.NATIVE, statedict.STATE_DICT, sharded.SHARDED)
_BY_NAME = {f.name: f for f in FORMATS}

__all__ = ["FORMATS", "Format", "Snapshot", "describe", "load", "read_file", "rebuild"]


def load(path: str | Path, *, trust: bool = False, max_memory: int | None = None) -> Snapshot:
    """Read and normalise a snapshot file (or sharded snapshot folder) of any supported format
    (`max_memory`: see `read_file`)."""
    obj = sharded.read_folder(path, max_memory) if Path(path).is_dir() else read_file(path, trust=trust,
                                                                                       max_memory=max_memory)
    if not isinstance(obj, dict):
        raise SnapshotError(f"{path}: not a snapshot: the file holds a {type(obj).__name__}, expected a dict")
    for fmt in FORMATS:
        if fmt.sniff(obj):
            return fmt.parse(str(path), obj)
    raise SnapshotError(f"{path}: not a snapshot in any format nanreplay knows")


def rebuild(snap: Snapshot, *, model: str | None, loss: str | None, device: str | None, trust: bool,
            max_memory: int | None = None):
    """The runnable step (a `replay.subject.Subject`) for a loaded snapshot."""
    return _BY_NAME[snap.format].rebuild(snap, model=model, loss=loss, device=device, trust=trust,
                                         max_memory=max_memory)


def describe(snap: Snapshot) -> dict:
    """The format's own facts about a snapshot (for `snapshot_info`)."""
    return _BY_NAME[snap.format].describe(snap)


def title(snap: Snapshot) -> str:
    return _BY_NAME[snap.format].title
