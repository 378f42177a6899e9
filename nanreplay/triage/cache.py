"""The result cache kept in OUTDIR: a re-run analyzes only new or changed snapshots."""

from __future__ import annotations

import json
from pathlib import Path

from nanreplay import __version__, atomic
from nanreplay.triage.rows import RETRY, Item

# The result cache kept in OUTDIR. Bump CACHE_SCHEMA on any incompatible change and say why here.
#   1 — first version.
#   2 — "dir": the folder (resolved) whose snapshots the entries describe; OUTDIR belongs to that folder.
CACHE_SCHEMA = "nanreplay.triage-cache/2"
CACHE_FILE = ".nanreplay-cache.json"  # a leading dot: no snapshot's output name can start with one


def read_cache(out: Path) -> dict | None:
    """The cache document as the last run left it; None when there is none or it is unreadable or of another version."""
    try:
        doc = json.loads((out / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != CACHE_SCHEMA or not isinstance(doc.get("entries"), dict):
        return None
    return doc


def cache_entries(doc: dict | None) -> dict[str, dict]:
    """rel -> entry of a cache document (an absent cache has none)."""
    if doc is None:
        return {}
    return {k: v for k, v in doc["entries"].items()
            if isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("row"), dict)}


def save_cache(outdir: Path, items: list[Item], old_cache: dict[str, dict], directory: Path) -> None:
    """Write the cache: every item's row that may be reused, plus `old_cache`'s entries of files no longer there."""
    # Entries of files that are gone stay until write() has removed their reports.
    current = {it.rel for it in items}
    entries = {rel: e for rel, e in old_cache.items() if rel not in current}
    for it in items:
        if it.row is None or it.key is None or it.row.get("failure") in RETRY:
            continue
        row = {k: v for k, v in it.row.items() if k not in ("cached", "duplicate_of")}
        entries[it.rel] = {"key": it.key, "sha256": it.sha256, "size": it.size, "mtime_ns": it.mtime_ns,
                           "name": it.name, "row": row}
    doc = {"schema": CACHE_SCHEMA, "nanreplay_version": __version__, "dir": str(directory.resolve()),
           "entries": entries}
    try:
        atomic.write_text(outdir / CACHE_FILE, json.dumps(doc, allow_nan=False))
    except OSError:
        pass  # a cache that cannot be written costs time next run, not results
