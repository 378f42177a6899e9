"""The training side: `NanGuard` writes a snapshot when a step goes non-finite.

Importing this package pulls in torch and nothing heavy (no pandas, jinja2 or click).
"""

from __future__ import annotations

from nanreplay.capture.guard import NanGuard
from nanreplay.errors import NonFiniteStep

__all__ = ["NanGuard", "NonFiniteStep"]
