"""One snapshot's row of results: the `Item` that carries it, the columns, how a failure is recorded."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nanreplay.sanitize import DISPLAY_LIMIT, cap
from nanreplay.triage.groups import group_id, signature

# Why a snapshot failed -> how the summary and the index say it.
FAILURES = {
    "unreadable": "unreadable",  # missing bytes, corrupt, truncated, not a snapshot
    "refused": "refused",  # would run code from the file; needs --trust
    "not_replayable": "not replayable",  # no or wrong model, loss, state that does not fit
    "over_limit": "over the memory limit",  # needs more than --max-memory
    "replay_error": "replay failed",  # the model raised during replay
    "timeout": "timed out",
    "crashed": "crashed",  # the worker died (segfault, out of memory)
    "output_error": "output not written",
    "internal_error": "internal error",  # a bug in nanreplay: the reason says what
}
# never cached: may pass next time (or with other limits, which are not part of the cache key)
RETRY = frozenset({"timeout", "crashed", "internal_error", "output_error", "over_limit"})

COLUMNS = ["file", "name", "status", "group", "verdict", "cause", "title", "op", "forward_op", "backward_node",
           "phase", "kind", "inf_sign", "module", "source", "source_path", "source_line", "code", "fix_kind", "fix_code",
           "fix_verified", "step", "rank", "world_size", "created", "format", "trigger", "failure", "reason",
           "duplicate_of", "cached", "seconds", "write_seconds", "sha256", "report", "json",
           "machine_verdict", "host", "device", "run",  # the guard's re-run (differential/machine.py; triage/machines.py)
           "function"]  # the culprit's function: part of the grouping key (groups.signature)
# Every other column is text (or empty). A value of another type — a snapshot whose `step` is a string,
# a rank that is a float — becomes empty, never an error: one bad file is one row, not the end of the run.
INT_COLUMNS = frozenset({"step", "rank", "world_size", "source_line"})
BOOL_COLUMNS = frozenset({"fix_verified", "cached"})
FLOAT_COLUMNS = frozenset({"seconds", "write_seconds"})
DETAIL_LIMIT = 20_000  # characters of a failure's detail (a traceback) kept

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
    hash_in_worker: bool = False  # too big to hash while planning: its worker hashes it

def as_int(v: Any) -> int | None:
    """An integer that fits a CSV's Int64 column, or None (bools, floats, strings and huge numbers are not)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63) else None


def clean_row(row: dict) -> dict:
    """Every column of its type (see INT_COLUMNS ...), every text capped: what any output can take as it is."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if k in INT_COLUMNS:
            v = as_int(v)
        elif k in BOOL_COLUMNS:
            v = v if isinstance(v, bool) else None
        elif k in FLOAT_COLUMNS:
            v = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None
        elif v is not None:
            v = cap(v if isinstance(v, str) else str(v), DETAIL_LIMIT if k == "detail" else DISPLAY_LIMIT)
        out[k] = v
    if out.get("status") not in ("analyzed", "failed"):
        out.update(status="failed", failure=out.get("failure") or "internal_error",
                   reason=out.get("reason") or "the row had no valid status")
    return out


def failed(category: str, reason: str, *, path: str | None = None, detail: str = "") -> dict:
    """The fields of a failed row: the category (a FAILURES key) and a one-line reason."""
    reason = " ".join(str(reason).split())
    if path and reason.startswith(f"{path}: "):  # the row already names the file
        reason = reason[len(path) + 2:]
    return {"status": "failed", "failure": category, "reason": reason, "detail": detail}


def make_row(it: Item, fields: dict, *, cached: bool = False) -> dict:
    """The full row of `it`: every column, its fields, and its group when it was analyzed."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(fields)
    row.update(file=it.rel, name=it.name, sha256=it.sha256, duplicate_of=it.duplicate_of, cached=cached)
    row = clean_row(row)
    row["group"] = group_id(signature(row)) if row["status"] == "analyzed" else None
    return row
