"""`nanreplay triage s3://bucket/prefix -o OUTDIR`: the snapshots under a URL, mirrored into OUTDIR, then triaged.

The snapshot objects under the prefix (with -r, at any depth; by suffix, as plan.discover) are downloaded into
`OUTDIR/.mirror/`, keeping their paths relative to the prefix, so that the rows, the output names and the parts
(`--shard`: a part downloads only its own snapshots) are those of a local triage of the same files. Each object's
size is checked against the per-snapshot memory bound before it is fetched (one over it is not downloaded and is
named), and a copy is fetched again only when the store's ETag (or size and time) changed: a hidden `.<name>.tag`
beside it records them. Copies of objects no longer listed are removed (only in the mirror, only those of this part).
Then the mirror is triaged as any local folder: confined, cached by content hash.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from nanreplay import remote
from nanreplay.errors import UsageError
from nanreplay.triage.plan import SNAPSHOT_SUFFIXES
from nanreplay.triage.shard import in_shard

MIRROR = ".mirror"


def default_outdir(url: str) -> str:
    return f"{PurePosixPath(url.split('://', 1)[1].rstrip('/')).name or 'snapshots'}.nanreplay"


def mirror(url: str, outdir: str, *, max_bytes: int, recursive: bool = False,
           shard: tuple[int, int] | None = None) -> tuple[str, list[str]]:
    """(the local mirror folder to triage, one line per object not downloaded)."""
    fs, base = remote.filesystem(url)
    base = base.rstrip("/")
    try:
        listing = fs.find(base, detail=True) if recursive else {
            e["name"]: e for e in fs.ls(base, detail=True) if e.get("type") != "directory"}
    except FileNotFoundError:
        raise UsageError(f"{url}: no such folder or prefix") from None
    except Exception as e:  # noqa: BLE001 - a client's errors (auth, network) are one line
        raise UsageError(f"{url}: cannot list: {type(e).__name__}: {e}") from None
    if not listing:
        raise UsageError(f"{url}: no such folder or prefix, or it is empty")
    local = Path(outdir) / MIRROR
    try:
        local.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{outdir}: cannot create the output folder: {e.strerror or e}") from None
    wanted: set[str] = set()
    skipped: list[str] = []
    for name, info in sorted(listing.items()):
        rel = PurePosixPath(name).relative_to(base).as_posix() if name.startswith(base + "/") else None
        if not rel or any(part.startswith(".") or part == ".." for part in rel.split("/")) \
                or PurePosixPath(rel).suffix.lower() not in SNAPSHOT_SUFFIXES:
            continue
        if shard is not None and not in_shard(rel, *shard):
            continue
        wanted.add(rel)
        size = info.get("size")
        if not isinstance(size, int) or size > max_bytes:
            skipped.append(f"{url.rstrip('/')}/{rel}: {size} bytes, over the memory limit of {max_bytes} bytes "
                           "(--max-memory); not downloaded")
            wanted.discard(rel)
            continue
        dest = local / rel
        tag = _tag(info)
        if dest.is_file() and dest.stat().st_size == size and _read(_tag_file(dest)) == tag:
            continue  # the copy is current
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.download")
        try:
            remote.download(fs, name, str(tmp), max_bytes, f"{url.rstrip('/')}/{rel}")
            os.replace(tmp, dest)
            _tag_file(dest).write_text(tag)
        except Exception as e:  # noqa: BLE001 - one object that cannot be fetched is one line, not the end
            skipped.append(str(e))
            try:
                tmp.unlink()
            except OSError:
                pass
    for f in local.rglob("*"):  # copies of objects gone from the store (this part's only)
        rel = f.relative_to(local).as_posix()
        if f.is_file() and not f.name.startswith(".") and rel not in wanted \
                and (shard is None or in_shard(rel, *shard)):
            f.unlink(missing_ok=True)
            _tag_file(f).unlink(missing_ok=True)
    return str(local), skipped


def _tag(info: dict) -> str:
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("crc32c")
    when = info.get("LastModified") or info.get("mtime") or info.get("updated") or info.get("created")
    return f"{etag}|{info.get('size')}|{when}"


def _tag_file(f: Path) -> Path:
    return f.with_name(f".{f.name}.tag")


def _read(f: Path) -> str | None:
    try:
        return f.read_text()
    except OSError:
        return None
