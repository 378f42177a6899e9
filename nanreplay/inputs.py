"""The inputs the user names, checked before any work — and before torch is imported, so a usage
error answers at once (outputs.py does the same for the outputs).

    snapshot_file(path)       a snapshot file: exists, a regular file, starts like a torch.save file
    snapshot_path(path)       what `analyze` accepts: such a file, or a sharded snapshot folder
    code_spec(spec, option)   `--model` / `--loss` spelled MODULE:NAME (a file path gets its dotted name)

Standard library only.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from nanreplay.errors import ModelError, SnapshotError

ZIP_MAGIC = b"PK\x03\x04"
# torch.save's legacy (pre-1.6) format starts with a protocol-2 pickle of this magic number.
LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."
SHARDED_CONTENTS = "nanreplay.json"  # what makes a folder a sharded snapshot (formats/sharded.py)

_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def snapshot_file(path: str | os.PathLike) -> tuple[os.stat_result, bool]:
    """Check `path` is a readable snapshot file; return its stat and whether it is a zip (torch.save's format)."""
    p = Path(path)
    try:
        st = os.stat(p)
        if stat.S_ISDIR(st.st_mode):
            raise SnapshotError(f"{path}: is a directory (use `nanreplay triage {path}` for a folder of snapshots)")
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block forever, a device never end
            raise SnapshotError(f"{path}: not a regular file, not a snapshot")
        with p.open("rb") as f:
            head = f.read(len(LEGACY_MAGIC))
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from None
    if not head:
        raise SnapshotError(f"{path}: empty file, not a snapshot")
    is_zip = head.startswith(ZIP_MAGIC)
    if not is_zip and not head.startswith(LEGACY_MAGIC):
        kind = "a plain pickle" if head[:1] == b"\x80" else "not a torch.save file"
        raise SnapshotError(f"{path}: not a snapshot ({kind}; expected a file written by torch.save)")
    return st, is_zip


def snapshot_path(path: str) -> None:
    """What `nanreplay analyze` accepts: a snapshot file, or a sharded snapshot folder (one with nanreplay.json)."""
    if os.path.isdir(path):
        folder_is_sharded(path)
    else:
        snapshot_file(path)


def folder_is_sharded(path: str | os.PathLike) -> None:
    """Refuse a folder that is not a sharded snapshot: say so first, then what to do with it."""
    p = Path(path)
    if (p / SHARDED_CONTENTS).exists() or (p / SHARDED_CONTENTS).is_symlink():
        return
    try:
        snapshots = sum(1 for e in os.scandir(p) if e.name.endswith((".pt", ".pth")))
    except OSError:
        snapshots = 0
    held = f"it holds {snapshots} snapshot file{'s' if snapshots != 1 else ''}; " if snapshots else ""
    raise SnapshotError(f"{path}: not a sharded snapshot (a folder without {SHARDED_CONTENTS}, or one whose writing "
                        f"did not finish); {held}to analyze a folder of snapshots, run `nanreplay triage {path}`")


def code_spec(spec: str, option: str) -> tuple[str, str]:
    """`spec` spelled MODULE:NAME (what `--model` and `--loss` take); returns (module, name). A module given
    as a file path (`models/net.py:build`) is refused with the dotted name to use instead."""
    mod, sep, attr = spec.partition(":")
    if sep and attr and ("/" in mod or "\\" in mod or mod.endswith(".py")):
        raise ModelError(f"{option} {spec!r}: MODULE is a file path; give the module's dotted name instead: "
                         f"{option} {_dotted(mod, attr)}")
    if not _SPEC.fullmatch(spec):
        raise ModelError(f"{option} {spec!r}: expected MODULE:NAME, e.g. mypkg.models:build")
    return mod, attr


def _dotted(mod: str, attr: str) -> str:
    p = Path(mod.replace("\\", "/"))
    p = p.with_suffix("") if p.suffix == ".py" else p
    parts = [s for s in p.parts if s not in ("", ".")]
    if p.is_absolute() or ".." in parts or not parts:
        return f"{p.name}:{attr} (with {p.parent} on PYTHONPATH)"
    return f"{'.'.join(parts)}:{attr} (run from the folder that holds {parts[0]}{'/' if len(parts) > 1 else '.py'})"
