"""Planning a triage run: find the snapshot files, name their outputs, hash them, reuse what the cache knows.

Light to import: no torch, pandas or jinja2 (the parent process never needs them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nanreplay import __version__
from nanreplay.errors import UsageError
from nanreplay.inputs import code_spec
from nanreplay.triage.cache import cache_entries, read_cache
from nanreplay.triage.lock import OutdirLock
from nanreplay.triage.rows import Item, failed, make_row
from nanreplay.triage.workpool import PoolStats

SNAPSHOT_SUFFIXES = (".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SHARDED_CONTENTS = "nanreplay.json"  # a folder holding it is one sharded snapshot: all ranks of one step (formats/sharded.py)
RESERVED_NAMES = frozenset({"index", "groups", "summary"})  # OUTDIR's own files
# Files up to this size are hashed while planning; a bigger one is hashed by its worker, under --timeout
# (a 20 GB sparse file would otherwise hold the parent for a minute before any analysis starts).
HASH_IN_PARENT = 64 << 20


@dataclass(frozen=True)
class Options:
    """The options that change what an analysis says: part of every cache key."""

    model: str | None = None
    loss: str | None = None
    trust: bool = False
    device: str | None = None
    verify: bool = True
    max_memory: int | None = None  # bytes per snapshot; not part of the key (refusals for size are never cached)

    def fingerprint(self) -> dict:
        return {"model": self.model, "loss": self.loss, "trust": self.trust, "device": self.device,
                "verify": self.verify, "nanreplay": __version__, "torch": _torch_version()}

@dataclass
class Plan:
    dir: Path
    outdir: Path
    options: Options
    items: list[Item]
    ignored: list[str]  # files in DIR that are not snapshots by name
    old_cache: dict[str, dict]  # rel -> entry, as the last run left it
    use_cache: bool = True
    stats: PoolStats | None = None
    lock: OutdirLock | None = None  # held until release(): one triage at a time per OUTDIR

    @property
    def todo(self) -> list[Item]:
        return [it for it in self.items if it.row is None]

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def default_outdir(directory: str) -> str:
    """`./<DIR's name>.nanreplay`, next to where the command runs (like analyze's reports)."""
    return f"{Path(directory).resolve().name or 'snapshots'}.nanreplay"


def plan(directory: str, outdir: str, *, options: Options, recursive: bool = False, use_cache: bool = True,
         shard: tuple[int, int] | None = None) -> Plan:
    """Validate DIR and OUTDIR, find the snapshots and reuse what the cache already knows.

    `shard=(i, n)`: only the i-th of n parts of the listing, written into OUTDIR's part folder (shard.py).
    """
    d, out = Path(directory), Path(outdir)
    top = out  # what the listing skips: OUTDIR itself, with every part folder in it
    for opt, spec in (("--model", options.model), ("--loss", options.loss)):
        # Only the spelling is checked here: importing user code is the workers' job.
        if spec and (":" in spec or opt == "--model"):
            code_spec(spec, opt)
    if not d.exists():
        raise UsageError(f"{directory}: no such folder")
    if not d.is_dir():
        raise UsageError(f"{directory}: not a folder (use `nanreplay analyze` for a single snapshot)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{outdir}: exists and is not a folder")
    if out.resolve() == d.resolve():
        raise UsageError(f"{outdir}: the output folder must not be DIR itself (triage never writes among the inputs)")
    if shard is not None:
        from nanreplay.triage.shard import part_folder

        out = part_folder(out, *shard)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{outdir}: cannot create the output folder: {e.strerror or e}") from None
    if not os.access(out, os.W_OK):
        raise UsageError(f"{outdir}: the output folder is not writable")
    lock = OutdirLock(out).acquire()
    try:
        return _plan(d, out, options=options, recursive=recursive, use_cache=use_cache, lock=lock, top=top,
                     shard=shard)
    except BaseException:
        lock.release()
        raise


def _plan(d: Path, out: Path, *, options: Options, recursive: bool, use_cache: bool, lock: OutdirLock,
          top: Path | None = None, shard: tuple[int, int] | None = None) -> Plan:
    doc = read_cache(out)
    if doc is not None and doc.get("dir") != str(d.resolve()):
        raise UsageError(f"{out}: holds the triage of another folder ({doc.get('dir')}); choose another -o, "
                         "or delete that folder first (triage never deletes or replaces another run's reports)")
    old = cache_entries(doc)
    rels, ignored = discover(d, top or out, recursive=recursive)
    items = [Item(path=str(d / rel), rel=rel) for rel in rels]
    assign_names(items)  # over the whole listing: a part names its snapshots as one run over all of them would
    if shard is not None:
        from nanreplay.triage.shard import in_shard

        items = [it for it in items if in_shard(it.rel, *shard)]
    fp = options.fingerprint()
    for it in items:
        _fingerprint(it, old.get(it.rel), fp)
        if it.sha256 is None:
            continue
        entry = old.get(it.rel)
        if use_cache and entry and entry.get("key") == it.key and entry.get("name") == it.name \
                and _outputs_exist(out, entry["row"]):
            it.row = make_row(it, dict(entry["row"]), cached=True)
    mark_duplicates(items)
    return Plan(dir=d, outdir=out, options=options, items=items, ignored=ignored, old_cache=old, use_cache=use_cache,
                lock=lock)


def mark_duplicates(items: list[Item]) -> None:
    """`duplicate_of`: the first file (in name order) with the same bytes, for every item whose hash is known."""
    first_of: dict[str, str] = {}
    for it in items:
        if it.sha256 is None:
            it.duplicate_of = ""
            continue
        dup = first_of.setdefault(it.sha256, it.rel)
        it.duplicate_of = dup if dup != it.rel else ""
        if it.row is not None:
            it.row["duplicate_of"] = it.duplicate_of


def discover(d: Path, out: Path, *, recursive: bool) -> tuple[list[str], list[str]]:
    """Snapshot files (by suffix), sharded snapshot folders (one item each: every rank of one step is one
    incident) and the other files, relative to d; hidden files and OUTDIR skipped."""
    out_r, d_r = out.resolve(), d.resolve()
    snaps: list[str] = []
    other: list[str] = []
    for root, dirs, files in os.walk(d):
        rootp = Path(root)
        visible = sorted(x for x in dirs if not x.startswith(".") and (rootp / x).resolve() != out_r)
        folders = [x for x in visible if is_sharded_folder(rootp / x)]
        snaps.extend((rootp / x).relative_to(d).as_posix() for x in folders)
        dirs[:] = [x for x in visible if x not in folders] if recursive else []
        for f in sorted(files):
            p = rootp / f
            if f.startswith(".") or not p.is_file():
                continue
            rel = p.relative_to(d).as_posix()
            if p.is_symlink() and not p.resolve().is_relative_to(d_r):
                # a stranger's folder may link to this user's files: neither hashed nor opened (analyze it by path)
                other.append(f"{rel} (a link to a file outside the folder: not followed)")
                continue
            (snaps if p.suffix.lower() in SNAPSHOT_SUFFIXES else other).append(rel)
    return snaps, other


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _base_name(rel: str) -> str:
    p = PurePosixPath(rel)
    parts = [*p.parent.parts, p.stem] if str(p.parent) != "." else [p.stem]
    name = "__".join(_UNSAFE.sub("_", s) for s in parts).strip(".")
    return name[:100] or "snapshot"


def assign_names(items: list[Item]) -> None:
    """A distinct output name per snapshot, stable across runs; never one of OUTDIR's own files.

    `a/x.pt` -> `a__x`; when two files would share a name (`x.pt` and `x.pth`, or names
    that differ only in case or in characters that are not safe in a file name), each
    gets a short hash of its path: `x-3f2a9c1b`.
    """
    base = {it.rel: _base_name(it.rel) for it in items}
    counts = Counter(n.casefold() for n in base.values())
    seen: set[str] = set()
    for it in items:
        n = base[it.rel]
        if counts[n.casefold()] > 1 or n.casefold() in RESERVED_NAMES:
            n = f"{n}-{hashlib.sha1(it.rel.encode()).hexdigest()[:8]}"
        unique, k = n, 2
        while unique.casefold() in seen:  # a hashed name that happens to equal a plain one
            unique, k = f"{n}-{k}", k + 1
        seen.add(unique.casefold())
        it.name = unique


def is_sharded_folder(p: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(p / SHARDED_CONTENTS).st_mode) and not p.is_symlink()
    except OSError:
        return False


def path_stat(path: str) -> tuple[int, int]:
    """(size, mtime_ns) of a snapshot file; of a sharded folder, its files' total size and latest mtime."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size, st.st_mtime_ns
    size, mtime = 0, st.st_mtime_ns
    for e in os.scandir(path):
        if e.is_file(follow_symlinks=False):
            est = e.stat(follow_symlinks=False)
            size, mtime = size + est.st_size, max(mtime, est.st_mtime_ns)
    return size, mtime


def content_hash(path: str) -> str:
    """sha256 of a snapshot file; of a sharded folder, of its files' names and contents."""
    if not os.path.isdir(path):
        return sha256_file(path)
    h = hashlib.sha256()
    for e in sorted(os.scandir(path), key=lambda e: e.name):
        if e.is_file(follow_symlinks=False):
            h.update(f"{e.name}\0{sha256_file(e.path)}\0".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _fingerprint(it: Item, entry: dict | None, fp: dict) -> None:
    """Content hash (reused when size and mtime match the last run) and cache key; a read error is a row.

    A file bigger than HASH_IN_PARENT that changed is left to its worker to hash (`hash_in_worker`).
    """
    try:
        it.size, it.mtime_ns = path_stat(it.path)
        if entry and entry.get("size") == it.size and entry.get("mtime_ns") == it.mtime_ns \
                and isinstance(entry.get("sha256"), str):
            it.sha256 = entry["sha256"]
        elif it.size > HASH_IN_PARENT:
            it.hash_in_worker = True
            return
        else:
            it.sha256 = content_hash(it.path)
    except OSError as e:
        it.row = make_row(it, failed("unreadable", f"cannot read: {e.strerror or e}"))
        return
    it.key = cache_key(it.sha256, fp)


def cache_key(sha256: str, fingerprint: dict) -> str:
    """What a cached row is valid for: the file's bytes, nanreplay's version and the options that change a result."""
    return hashlib.sha256(json.dumps({"sha256": sha256, **fingerprint}, sort_keys=True).encode()).hexdigest()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _outputs_exist(out: Path, row: dict) -> bool:
    return all((out / row[k]).is_file() for k in ("report", "json") if row.get(k))


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:  # pragma: no cover
        return "unknown"
