"""Reading tensors from a torch.distributed.checkpoint (DCP) folder without DCP's pickled metadata.

DCP's `FileSystemReader.read_metadata()` is `pickle.load(open(".metadata"))`: a crafted folder would
run code there. nanreplay never calls it. A sharded snapshot carries DCP's storage index as plain JSON
(nanreplay.json's "tensors", validated by formats/sharded.py); `SafeReader` hands DCP a `Metadata`
built from that data, and DCP then does what it always does: plans the reads, reshards (a tensor saved
as N shards loads whole on one process, or as M shards on M ranks) and loads each chunk with
`torch.load(weights_only=True)`.

Before DCP reads a byte, every chunk it will read is checked here: its file is a plain file in the
folder (no path, no link, no special file), its byte range lies inside the file, it can hold the chunk's
data, and the zip archive in it declares no more data than the range holds (torch.save never
compresses). What is guaranteed and what is not: docs/sharded.md, "Loading safely".
"""

from __future__ import annotations

import io
import os
import re
import stat
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanreplay.errors import LimitError, SnapshotError, first_line
from nanreplay.formats.program import DTYPES
from nanreplay.limits import format_size

FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")  # no path separator, not hidden
_SLACK = 1 << 20  # a torch.save archive's own records (pickle, version, byteorder) beyond the data


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None  # None only for an empty chunk
    offset: int = 0
    length: int = 0


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: dtype, global shape and the chunks that tile it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


def numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def check_tiling(key: str, e: Entry) -> None:
    """The chunks lie inside the tensor and cover every element exactly once (DCP writes all of them;
    a gap would leave memory unwritten, an overlap is not something DCP writes)."""
    dims = len(e.shape)
    for c in e.chunks:
        if len(c.offsets) != dims or len(c.sizes) != dims:
            raise SnapshotError(f"chunk of {key!r} has {len(c.offsets)} offsets for a {dims}-d tensor")
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, e.shape, strict=True)):
            raise SnapshotError(f"a chunk of {key!r} lies outside its shape {list(e.shape)}")
    full = [c for c in e.chunks if numel(c.sizes)]
    if sum(numel(c.sizes) for c in full) != numel(e.shape):
        raise SnapshotError(f"the chunks of {key!r} do not cover its {numel(e.shape)} elements exactly")
    if dims == 0 or len(full) <= 1:
        return
    if all(c.offsets[1:] == (0,) * (dims - 1) and c.sizes[1:] == e.shape[1:] for c in full):  # row blocks (FSDP)
        rows = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in full)
        if any(a[1] > b[0] for a, b in zip(rows, rows[1:], strict=False)):
            raise SnapshotError(f"chunks of {key!r} overlap")
        return
    if len(full) > 512:
        raise SnapshotError(f"{key!r} is split into {len(full)} chunks of arbitrary shape; nanreplay checks at most 512")
    for i, a in enumerate(full):
        for b in full[i + 1:]:
            if all(x < y + t and y < x + s for x, s, y, t in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)):
                raise SnapshotError(f"chunks of {key!r} overlap")


class _Slice(io.RawIOBase):
    """A read-only view of bytes [offset, offset + length) of an open file."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.base, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        self.pos = max(0, min(self.pos, self.length))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = min(len(b), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.base + self.pos)
        data = self.f.read(n)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


def check_files(folder: Path, entries: dict[str, Entry], keys: list[str]) -> int:
    """Check every chunk `keys` need (see the module docstring); returns the bytes DCP will read."""
    sizes: dict[str, int] = {}
    total = 0
    for key in keys:
        e = entries[key]
        for c in e.chunks:
            if not numel(c.sizes):
                continue
            if c.file is None:
                raise SnapshotError(f"a chunk of {key!r} names no file")
            size = sizes.get(c.file)
            if size is None:
                size = sizes[c.file] = _file_size(folder, c.file)
            need = numel(c.sizes) * e.dtype.itemsize
            if c.offset < 0 or c.length < need or c.offset + c.length > size:
                raise SnapshotError(f"a chunk of {key!r} claims bytes {c.offset}..{c.offset + c.length} of {c.file}, "
                                    f"which is {size} bytes long (the chunk's data alone is {need} bytes)")
            _check_archive(folder / c.file, c, key)
            total += c.length
    return total


def _file_size(folder: Path, name: str) -> int:
    if not FILE_NAME.fullmatch(name):
        raise SnapshotError(f"the storage index names {name[:80]!r}, which is not a plain file name in the folder")
    try:
        st = os.lstat(folder / name)
    except OSError as e:
        raise SnapshotError(f"{name}: cannot read: {e.strerror or e} (an incomplete copy of the folder?)") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise SnapshotError(f"{name}: not a regular file (links and special files are never read)")
    return st.st_size


def _check_archive(path: Path, c: Chunk, key: str) -> None:
    try:
        with open(path, "rb") as f, zipfile.ZipFile(_Slice(f, c.offset, c.length)) as z:
            declared = sum(max(0, i.file_size) for i in z.infolist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        raise SnapshotError(f"{path.name}: the bytes of a chunk of {key!r} are not a torch.save archive "
                            f"({type(e).__name__})") from None
    if declared > 2 * c.length + _SLACK:
        raise SnapshotError(f"{path.name}: a chunk of {key!r} declares {format_size(declared)} of data in "
                            f"{format_size(c.length)} (torch.save never compresses; a zip bomb?)")


def load(folder: str | Path, entries: dict[str, Entry], targets: dict[str, torch.Tensor], *,
         max_memory: int | None = None) -> None:
    """Fill `targets` (key -> tensor, plain or DTensor, already the right shape) from the folder's chunks."""
    folder = Path(folder)
    keys = list(targets)
    missing = [k for k in keys if k not in entries]
    if missing:
        raise SnapshotError(f"{folder}: the checkpoint holds no tensor {missing[0]!r}")
    for k in keys:
        t, e = targets[k], entries[k]
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise SnapshotError(f"{folder}: {k!r} is {list(e.shape)} {e.dtype} in the checkpoint, "
                                f"not {list(t.shape)} {t.dtype}")
    read = check_files(folder, entries, keys)
    if max_memory is not None and read > max_memory:
        raise LimitError(f"{folder}: reading these tensors means {format_size(read)} of chunks, more than "
                         f"--max-memory {format_size(max_memory)}")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
            dcp.load(targets, storage_reader=SafeReader(folder, {k: entries[k] for k in keys}),
                     planner=DefaultLoadPlanner(flatten_state_dict=False), no_dist=True)
    except (SnapshotError, LimitError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; each becomes one line
        inner = _root(e)
        msg = str(inner)
        if "Weights only load failed" in msg:
            m = re.search(r"GLOBAL ([\w.]+)", msg)
            refs = f" (it references {m.group(1)})" if m else ""
            raise SnapshotError(f"{folder}: cannot read the checkpoint: a chunk holds pickled Python objects{refs}; "
                                "nanreplay never loads those from a sharded snapshot, not even with --trust") from None
        raise SnapshotError(f"{folder}: cannot read the checkpoint: {type(inner).__name__}: {first_line(inner)}") from None


def _root(e: BaseException) -> BaseException:
    """DCP wraps a rank's failure in a CheckpointException: say the rank's own error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, BaseException):
            return inner
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            return inner[0]
    return e


def entries_of(index: dict[str, Any]) -> dict[str, Entry]:
    """Entries from nanreplay.json's validated "tensors" (formats/sharded.py checks the types first)."""
    out = {}
    for key, d in index.items():
        chunks = tuple(Chunk(tuple(c["offsets"]), tuple(c["sizes"]), c.get("file"), c.get("offset", 0),
                             c.get("length", 0)) for c in d["chunks"])
        out[key] = Entry(DTYPES[d["dtype"]], tuple(d["shape"]), chunks)
    return out


def _reader_base():
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader


class SafeReader(_reader_base()):
    """DCP's own file reader, with its metadata built from validated data instead of unpickled."""

    def __init__(self, folder: str | Path, entries: dict[str, Entry]):
        super().__init__(str(folder))
        self._entries = entries

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        tensors, storage = {}, {}
        for key, e in self._entries.items():
            chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in e.chunks]
            tensors[key] = TensorStorageMetadata(TensorProperties(dtype=e.dtype), torch.Size(e.shape), chunks)
            for c in e.chunks:
                if c.file is not None and numel(c.sizes):
                    storage[MetadataIndex(key, c.offsets)] = _StorageInfo(c.file, c.offset, c.length)
        return Metadata(tensors, storage_data=storage, storage_meta=StorageMeta(load_id=self.load_id))
