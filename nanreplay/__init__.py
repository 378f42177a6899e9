"""nanreplay: find the op that made your training step NaN or Inf.

Training side:  `from nanreplay import NanGuard` (light: imports only torch).
Analysis side:  `nanreplay.analyze(path, ...)` or the `nanreplay` command.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["NanGuard", "analyze", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `import nanreplay` in a training script stays cheap.
    if name == "NanGuard":
        from nanreplay.capture import NanGuard

        return NanGuard
    if name == "analyze":
        from nanreplay.analysis import analyze

        return analyze
    raise AttributeError(f"module 'nanreplay' has no attribute {name!r}")
