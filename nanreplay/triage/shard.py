"""Triage split over a cluster's own scheduler: `--shard I/N` runs one part, `--merge OUTDIR` joins the parts.

Which part a snapshot belongs to is a hash of its path relative to DIR, not its position in the listing: a file
added to DIR lands in one part and moves no other file, and a re-run part finds its own reports in its own cache.
(Not the content hash: a snapshot rewritten in place would then move to another part and leave a stale row behind
in the old one.) Each part is an ordinary triage OUTDIR, `OUTDIR/parts/part-<I>-of-<N>/`, with its own lock, cache,
reports and index, plus `part.json`: every row it analyzed, for the merge.

merge.py joins the parts.

Light to import: no torch, pandas or jinja2 at the top (as the rest of triage's parent side).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path, PurePosixPath

from nanreplay import __version__, atomic
from nanreplay.errors import UsageError

PARTS = "parts"
PART_FILE = "part.json"
PART_SCHEMA = "nanreplay.triage-part/1"
PART_DIR = re.compile(r"part-(\d{1,6})-of-(\d{1,6})")
MAX_PARTS = 100_000


def parse_shard(spec: str) -> tuple[int, int]:
    """`I/N` (0 <= I < N): the part to run. Slurm's $SLURM_ARRAY_TASK_ID with --array=0-(N-1), Kubernetes'
    $JOB_COMPLETION_INDEX."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec or "")
    if not m:
        raise UsageError(f"--shard {spec}: expected I/N, e.g. 0/4 (the part I of N, counted from 0)")
    i, n = int(m.group(1)), int(m.group(2))
    if not 0 < n <= MAX_PARTS:
        raise UsageError(f"--shard {spec}: N must be between 1 and {MAX_PARTS}")
    if i >= n:
        raise UsageError(f"--shard {spec}: I counts from 0 and must be below N (Slurm: --array=0-{n - 1})")
    return i, n


def in_shard(rel: str, i: int, n: int) -> bool:
    """Whether the snapshot at `rel` (relative to DIR) belongs to part i of n."""
    h = hashlib.sha256(rel.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(h[:8], "big") % n == i


def part_name(i: int, n: int) -> str:
    return f"part-{i}-of-{n}"


def part_folder(out: Path, i: int, n: int) -> Path:
    return out / PARTS / part_name(i, n)


def listing_key(rel: str, folder: bool) -> tuple:
    """The place of `rel` in plan.discover()'s order: in each folder its sharded-snapshot folders, then its files,
    then its subfolders, each by name."""
    *dirs, last = PurePosixPath(rel).parts
    return (*((2, d) for d in dirs), (0 if folder else 1, last))


def write_part(p, i: int, n: int) -> None:
    """Before write() (which unlocks the folder): the part's rows (and what the merge must check) in its folder's part.json."""
    rows = []
    for it in p.items:
        if it.row is not None:
            rows.append({**it.row, "_folder": os.path.isdir(it.path)})
    doc = {"schema": PART_SCHEMA, "nanreplay_version": __version__, "part": i, "of": n, "dir": str(p.dir),
           "options": {"model": p.options.model, "loss": p.options.loss, "trust": p.options.trust},
           "fingerprint": p.options.fingerprint(), "ignored": p.ignored, "rows": rows}
    try:
        atomic.write_text(p.outdir / PART_FILE, json.dumps(doc, allow_nan=False))
    except OSError as e:
        raise UsageError(f"{p.outdir}: cannot write {PART_FILE}: {e.strerror or e}") from None


def span(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (Slurm's --array syntax: paste it to re-run just those)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)
