"""One snapshot's row of results: the `Item` that carries it, the columns, how a failure is recorded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanreplay.triage.groups import group_id, signature

# Why a snapshot failed -> how the summary and the index say it.
FAILURES = {
    "unreadable": "unreadable",  # missing bytes, corrupt, truncated, not a snapshot
    "refused": "refused",  # would run code from the file; needs --trust
    "not_replayable": "not replayable",  # no or wrong model, loss, state that does not fit
    "replay_error": "replay failed",  # the model raised during replay
    "timeout": "timed out",
    "crashed": "crashed",  # the worker died (segfault, out of memory)
    "output_error": "output not written",
    "internal_error": "internal error",  # a bug in nanreplay: the reason says what
}
RETRY = frozenset({"timeout", "crashed", "internal_error", "output_error"})  # never cached: may pass next time

COLUMNS = ["file", "name", "status", "group", "verdict", "cause", "title", "op", "forward_op", "backward_node",
           "phase", "kind", "module", "source", "source_path", "source_line", "code", "fix_kind", "fix_code",
           "fix_verified", "step", "rank", "world_size", "created", "format", "trigger", "failure", "reason",
           "duplicate_of", "cached", "seconds", "write_seconds", "sha256", "report", "json"]

@dataclass
class Item:
    """One snapshot file and, once known, its row of results."""

    path: str  # DIR/rel, as the user spelled DIR: what the reports show
    rel: str  # relative to DIR, '/'-separated
    name: str = ""  # output stem in OUTDIR: <name>.html, <name>.json
    size: int = 0
    mtime_ns: int = 0
    sha256: str | None = None
    key: str | None = None  # content hash + nanreplay version + options
    duplicate_of: str = ""  # the first file (in name order) with the same bytes
    row: dict | None = None

def failed(category: str, reason: str, *, path: str | None = None, detail: str = "") -> dict:
    """The fields of a failed row: the category (a FAILURES key) and a one-line reason."""
    reason = " ".join(reason.split())
    if path and reason.startswith(f"{path}: "):  # the row already names the file
        reason = reason[len(path) + 2:]
    return {"status": "failed", "failure": category, "reason": reason, "detail": detail}


def make_row(it: Item, fields: dict, *, cached: bool = False) -> dict:
    """The full row of `it`: every column, its fields, and its group when it was analyzed."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(fields)
    row.update(file=it.rel, name=it.name, sha256=it.sha256, duplicate_of=it.duplicate_of, cached=cached)
    row["group"] = group_id(signature(row)) if row["status"] == "analyzed" else None
    return row
