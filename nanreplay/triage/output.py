"""Triage's outputs in OUTDIR: groups.json, summary.csv and index.html, written once the rows are in."""

from __future__ import annotations

import json
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from nanreplay import __version__, atomic, interrupt
from nanreplay.errors import UsageError
from nanreplay.triage.cache import save_cache
from nanreplay.triage.groups import build_groups, build_ranks
from nanreplay.triage.index import render_index
from nanreplay.triage.machines import build_machines
from nanreplay.triage.plan import Plan, mark_duplicates
from nanreplay.triage.rows import COLUMNS, FAILURES, INT_COLUMNS, as_int

SCHEMA = "nanreplay.triage/1"  # groups.json


@dataclass
class Result:
    rows: list[dict]
    groups: list[dict]
    failures: list[dict]
    ranks: dict | None
    summary: str  # the one line
    index: Path
    counts: dict = field(default_factory=dict)
    doc: dict = field(default_factory=dict)  # groups.json as written: what the index and the Markdown summary show

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0


def write(p: Plan) -> Result:
    """Group the rows and write groups.json, summary.csv and index.html (all atomically)."""
    mark_duplicates(p.items)  # workers hashed the big files: now every hash is known
    rows = [it.row for it in p.items if it.row is not None]
    doc = {"schema": SCHEMA, "nanreplay_version": __version__, "dir": str(p.dir),
           "options": {"model": p.options.model, "loss": p.options.loss, "trust": p.options.trust},
           **tally(rows, len(p.ignored)), "ignored": p.ignored}
    with interrupt.deferred():  # Ctrl-C from here waits: the old index and its files, or a whole new set
        _remove_stale_outputs(p)
        p.old_cache = {}  # cleaned up: the cache now holds only what this run has
        save_cache(p.outdir, p.items, p.old_cache, p.dir)
        try:
            return save(p.outdir, doc, rows, "triage outputs")
        finally:
            p.release()


def tally(rows: list[dict], ignored: int) -> dict:
    """What groups.json says of the rows: the one-line summary, counts, groups, failures, ranks, machines."""
    groups = build_groups(rows)
    failures = [{"file": r["file"], "failure": r["failure"], "label": FAILURES.get(r["failure"], r["failure"]),
                 "reason": r["reason"], **({"detail": r["detail"]} if r.get("detail") else {})}
                for r in rows if r["status"] != "analyzed"]
    machines = build_machines(rows)
    counts = {"snapshots": len(rows), "analyzed": len(rows) - len(failures), "failed": len(failures),
              "cached": sum(bool(r["cached"]) for r in rows), "groups": len(groups), "ignored": ignored,
              "failures": dict(Counter(f["failure"] for f in failures))}
    return {"summary": summary_line(counts, groups, machines), "counts": counts, "groups": groups,
            "failures": failures, "ranks": build_ranks(rows), "machines": machines}


def save(outdir: Path, doc: dict, rows: list[dict], what: str) -> Result:
    """groups.json, summary.csv and index.html in `outdir`, each written atomically."""
    try:
        atomic.write_texts([(outdir / "groups.json", json.dumps(doc, indent=2, allow_nan=False)),
                            (outdir / "summary.csv", summary_csv(rows)),
                            (outdir / "index.html", render_index(doc))])  # all three or none (a full disk)
    except OSError as e:
        raise UsageError(f"{outdir}: cannot write the {what}: {e.strerror or e}") from None
    return Result(rows=rows, groups=doc["groups"], failures=doc["failures"], ranks=doc["ranks"],
                  summary=doc["summary"], index=outdir / "index.html", counts=doc["counts"], doc=doc)


def summary_line(counts: dict, groups: list[dict], machines: dict | None = None) -> str:
    causes = sum(g["verdict"] != "not_reproduced" for g in groups)
    parts = [_plural(counts["snapshots"], "snapshot"), _plural(causes, "root cause")]
    not_repro = sum(g["count"] for g in groups if g["verdict"] == "not_reproduced")
    if not_repro:
        parts.append(f"{not_repro} not reproduced")
    parts += [f"{n} {FAILURES.get(cat, cat)}" for cat, n in sorted(counts["failures"].items())]
    line = ", ".join(parts)
    if counts["cached"]:
        line += f" ({counts['cached']} from cache)"
    if counts["ignored"]:
        line += f"; {_plural(counts['ignored'], 'other file')} ignored"
    if machines and machines["transient"]:  # the device the fleet's own snapshots name
        line += f"; {machines['summary']}"
    return line


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _inert(v):
    """A cell a spreadsheet would read as a formula — one that starts with =, +, -, @, a tab or a carriage return —
    gets an apostrophe in front. A cell of signs alone (inf_sign's "+", "-", "+-") names nothing and computes
    nothing: it stays as it is."""
    if isinstance(v, str) and v and v[:1] in "=+-@\t\r" and v.strip("+-"):
        return "'" + v
    return v


def summary_csv(rows: list[dict]) -> str:
    import pandas as pd

    df = pd.DataFrame(rows, columns=COLUMNS)
    for col in sorted(INT_COLUMNS):  # integers with gaps: not 12.0; anything else (a string step) stays empty
        df[col] = pd.array([as_int(r.get(col)) for r in rows], dtype="Int64")  # from the rows: df made them floats
    # A cell a spreadsheet would read as a formula (=, +, -, @) is quoted: file names and code come
    # from the snapshots, and a CSV must not run anything when opened.
    for col in df.columns:
        if not (pd.api.types.is_numeric_dtype(df[col]) or pd.api.types.is_bool_dtype(df[col])):
            df[col] = df[col].map(_inert)
    return df.to_csv(index=False)


def _remove_stale_outputs(p: Plan) -> None:
    """Delete reports an earlier triage of this same DIR wrote that no current snapshot owns.

    Only names the cache of this DIR recorded (plan() refuses an OUTDIR that holds another DIR's
    triage), only in OUTDIR, and only regular files: nothing this tool did not write is deleted.
    """
    live = {it.name for it in p.items if it.row is not None and it.row["status"] == "analyzed"}
    for entry in p.old_cache.values():
        name = entry.get("name")
        if not isinstance(name, str) or not name or name in live or "/" in name or "\\" in name \
                or name.startswith("."):
            continue
        for suffix in ("html", "json"):
            f = p.outdir / f"{name}.{suffix}"
            try:
                if stat.S_ISREG(os.lstat(f).st_mode):
                    f.unlink()
            except OSError:
                continue
