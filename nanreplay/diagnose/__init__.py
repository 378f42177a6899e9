"""Why the culprit broke the step, and what to change: one registry of cause rules (see docs/architecture.md)."""

from __future__ import annotations

from nanreplay.diagnose.core import RULES, Diagnosis, Fix, Site, choose_eps, diagnose, for_leaves, rule

__all__ = ["RULES", "Diagnosis", "Fix", "Site", "choose_eps", "diagnose", "for_leaves", "rule"]
