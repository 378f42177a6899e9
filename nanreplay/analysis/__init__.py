"""`analyze()` (the pipeline) and `Analysis` (its result, the JSON contract as types)."""

from __future__ import annotations

from nanreplay.analysis.contract import SCHEMA, Analysis
from nanreplay.analysis.pipeline import analyze

__all__ = ["SCHEMA", "Analysis", "analyze"]
