"""Why the culprit broke the step, and what to change: one registry of cause rules.

model.py (Diagnosis, Fix, the registry and @rule), site.py (the culprit as rules see it),
fixes.py (epsilon policy, call-site patches), codefix.py (the fix on the user's own line),
rules/ (the causes, one file per family), engine.py (dispatch and verification), prose.py.
"""

from __future__ import annotations

from nanreplay.diagnose.engine import diagnose, for_leaves
from nanreplay.diagnose.fixes import choose_eps
from nanreplay.diagnose.model import RULES, Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site

__all__ = ["RULES", "Diagnosis", "Fix", "Site", "choose_eps", "diagnose", "for_leaves", "rule"]
