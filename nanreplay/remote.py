"""Snapshots in object storage: `s3://`, `gs://`, `file://`, anything fsspec reaches.

Reading (`nanreplay analyze s3://bucket/run/nan_step...pt`): the object's reported size is checked against the
memory bound before a byte is fetched, then it is copied, counting bytes (a size that lied stops the copy), into a
private folder (0700) under its own name, and analyzed exactly as a local file, confined as always. The copy is
removed when the command ends.

Writing (`NanGuard(folder="s3://bucket/run-17/nan")`): the guard writes the snapshot locally as always, then this
module uploads it whole. An object store publishes an object only once its upload completes (a single PUT, or a
multipart upload's final call), so a reader never sees part of a snapshot under its final name; on a file system
(`file://`) the upload goes to a temporary name and is renamed. A failed upload is the guard's one warning; the
local copy stays and is named in it.

The clients (s3fs for s3://, gcsfs for gs://) are optional extras, `nanreplay[s3]` and `nanreplay[gcs]`. Nothing
here imports fsspec or a client until such a path is used: stdlib only at the top (the guard imports this module).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import PurePosixPath

from nanreplay.errors import SnapshotError, UsageError

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
CHUNK = 8 << 20


def is_url(path: object) -> bool:
    """`s3://...`, `gs://...`, `file://...`: a path for fsspec, not for the local file system."""
    return isinstance(path, str) and _URL.match(path) is not None


def filesystem(url: str):
    """(fsspec file system, path within it); one clear line when the client is not installed."""
    try:
        import fsspec
    except ImportError:
        raise UsageError(f"{url}: reading object storage needs fsspec (pip install fsspec)") from None
    protocol = url.split("://", 1)[0].lower()
    if protocol == "file":  # a file URI percent-encodes its path (RFC 8089: Path.as_uri() of "a b" is "a%20b"),
        from urllib.parse import unquote  # which fsspec's local file system takes literally

        url = "file://" + unquote(url.split("://", 1)[1])
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        extra = EXTRAS.get(protocol)
        hint = f"pip install 'nanreplay[{extra}]'" if extra else f"install fsspec's client for {protocol}://"
        raise UsageError(f"{url}: no client for {protocol}:// is installed ({hint})") from None
    except ValueError as e:  # a protocol fsspec does not know
        raise UsageError(f"{url}: no client for {protocol}:// ({e})") from None


def local_copy(url: str, max_bytes: int) -> str:
    """A private local copy of the snapshot at `url` (removed when the process exits); its path."""
    fs, path = filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise SnapshotError(f"{url}: no such object") from None
    except Exception as e:  # noqa: BLE001 - a client's errors (auth, network) are one line, not a traceback
        raise SnapshotError(f"{url}: cannot read: {type(e).__name__}: {e}") from None
    if info.get("type") == "directory":
        raise SnapshotError(f"{url}: is a folder (download it and run `nanreplay triage` on the copy)")
    size = info.get("size")
    if not isinstance(size, int):
        raise SnapshotError(f"{url}: the store does not say the object's size; download it first")
    if size > max_bytes:
        raise SnapshotError(f"{url}: {size} bytes is over the memory limit of {max_bytes} bytes "
                            "(--max-memory); nothing was downloaded")
    folder = tempfile.mkdtemp(prefix="nanreplay-remote-")  # 0700: this user only
    atexit.register(shutil.rmtree, folder, True)
    name = PurePosixPath(path).name or "snapshot.pt"
    if name.startswith("."):
        name = "snapshot" + name
    dest = os.path.join(folder, name)
    try:
        download(fs, path, dest, max_bytes, url)
    except SnapshotError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return dest


def download(fs, path: str, dest: str, max_bytes: int, url: str) -> None:
    """Copy `path` of `fs` to the new file `dest`, at most `max_bytes` (an object that grew, or whose size lied,
    stops the copy); a partial copy is removed. Any failure is a SnapshotError."""
    got = 0
    try:
        out = open(dest, "xb")  # noqa: SIM115 - closed below; a file that exists is never touched
    except OSError as e:
        raise SnapshotError(f"{dest}: cannot create the local copy: {e.strerror or e}") from None
    try:
        with fs.open(path, "rb") as src, out:
            while chunk := src.read(CHUNK):
                got += len(chunk)
                if got > max_bytes:
                    raise SnapshotError(f"{url}: more than {max_bytes} bytes (--max-memory); download stopped")
                out.write(chunk)
    except SnapshotError:
        _unlink(dest)
        raise
    except Exception as e:  # noqa: BLE001 - a client's errors (auth, network) are one line
        _unlink(dest)
        raise SnapshotError(f"{url}: cannot download: {type(e).__name__}: {e}") from None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def staging_folder(url: str) -> str:
    """Where a guard whose folder is `url` writes its snapshots before uploading them."""
    return tempfile.mkdtemp(prefix="nanreplay-upload-")


def upload(local: str, folder_url: str) -> str:
    """Upload the snapshot file `local` whole into `folder_url`; its URL. Raises on any failure (the guard warns)."""
    if os.path.isdir(local):
        raise OSError("a sharded snapshot folder is not uploaded (write it to a shared file system)")
    fs, base = filesystem(folder_url)
    name = os.path.basename(local)
    final = base.rstrip("/") + "/" + name
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:  # a file system: a temporary name, then a rename
        fs.makedirs(base, exist_ok=True)
        tmp = base.rstrip("/") + f"/.{name}.{os.getpid()}.uploading"
        fs.put_file(local, tmp)
        fs.mv(tmp, final)
    else:  # an object store publishes the object only when its upload is complete
        fs.put_file(local, final)
    return folder_url.rstrip("/") + "/" + name
