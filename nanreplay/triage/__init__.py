"""`nanreplay triage DIR`: every snapshot in a folder, analyzed in parallel, grouped by root cause."""

from __future__ import annotations

from nanreplay.triage.core import (
                                   CACHE_FILE,
                                   Item,
                                   Options,
                                   Plan,
                                   Result,
                                   analyze,
                                   assign_names,
                                   build_groups,
                                   build_ranks,
                                   default_jobs,
                                   default_outdir,
                                   plan,
                                   summary_csv,
                                   write,
)

__all__ = ["CACHE_FILE", "Item", "Options", "Plan", "Result", "analyze", "assign_names", "build_groups", "build_ranks",
           "default_jobs", "default_outdir", "plan", "summary_csv", "write"]
