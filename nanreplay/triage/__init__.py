"""`nanreplay triage DIR`: every snapshot in a folder, analyzed in parallel, grouped by root cause.

A pipeline of plain functions that the CLI calls in turn:

    plan()     lock OUTDIR, find the snapshot files, hash them (files over 64 MiB: in the workers),
               reuse cached results, name the outputs                            (plan.py, cache.py, lock.py)
    analyze()  analyze the rest in a WorkerPool; each worker writes <name>.html and <name>.json
               (parallel.py in the parent, worker.py in the workers, workpool.py the pool)
    write()    group the rows; write groups.json, summary.csv, index.html and the cache; unlock
               (groups.py, output.py, index.py); markdown_summary() the groups for a ticket (markdown.py)

A snapshot that cannot be analyzed (unreadable, hostile, no model for it, a replay that
raises or hangs) becomes a failed row with a one-line reason (rows.py); a field of the wrong type
(a string `step`) becomes an empty cell; neither stops the run. Input files are only ever read:
everything is written inside OUTDIR, which may not be DIR, and only what an earlier triage of the
same DIR wrote is ever deleted there.

The package stays light to import (no torch, pandas or jinja2 at the top): the parent
process never needs torch, and the workers import it once, not per snapshot.
"""

from __future__ import annotations

from nanreplay.triage.cache import CACHE_FILE
from nanreplay.triage.groups import build_groups, build_ranks
from nanreplay.triage.markdown import markdown_summary
from nanreplay.triage.output import Result, summary_csv, write
from nanreplay.triage.parallel import analyze, default_jobs
from nanreplay.triage.plan import Options, Plan, assign_names, default_outdir, plan
from nanreplay.triage.rows import Item

__all__ = ["CACHE_FILE", "Item", "Options", "Plan", "Result", "analyze", "assign_names", "build_groups", "build_ranks",
           "default_jobs", "default_outdir", "markdown_summary", "plan", "summary_csv", "write"]
