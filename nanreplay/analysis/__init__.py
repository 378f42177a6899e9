"""`analyze()` (the pipeline) and `Analysis` (its result, the JSON contract as types).

`analyze` is imported on first use: reading and rendering an `Analysis` needs no torch (confine/).
"""

from __future__ import annotations

from nanreplay.analysis.result import SCHEMA, Analysis

__all__ = ["SCHEMA", "Analysis", "analyze"]


def __getattr__(name: str):
    if name == "analyze":
        from nanreplay.analysis.pipeline import analyze

        return analyze
    raise AttributeError(f"module 'nanreplay.analysis' has no attribute {name!r}")
