"""The cause rules, one file per family. Adding a cause is one function in one family file,
registered with `@rule(cause, *ops, priority=N)`; importing this package registers them all.
Dispatch order comes from the priorities alone (see diagnose/model.py), not from this list."""

from __future__ import annotations

from nanreplay.diagnose.rules import (
    constants,
    division,
    domain,
    forms,
    generic,
    kldiv,
    logcosh,
    logprod,
    logratio,
    logs,
    optimizer,
    precision,
    roots_powers,
    scalar_divisor,
    smoothing,
    softmax,
    spectral,
    support,
    underflow,
    where,
)

__all__ = ["constants", "division", "domain", "forms", "generic", "kldiv", "logcosh", "logprod", "logratio", "logs", "optimizer",
           "precision", "roots_powers",
           "scalar_divisor", "smoothing", "softmax", "spectral", "support", "underflow", "where"]
