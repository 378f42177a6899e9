"""Numbers as people read them: one formatter for prose, reports and the terminal. Imports no torch (the parent
of a confined analysis renders without it)."""

from __future__ import annotations

import math
from typing import Any

NONFINITE_TEXT = {"nan": "NaN", "inf": "+Inf", "-inf": "−Inf"}  # jsonable's strings, as people read them


def num(x: Any, digits: int = 4) -> str:
    """A number for people: 4 significant digits, NaN/+Inf/−Inf spelled out, '—' for none.

    The one way prose and reports write a measured number: never a 17-digit repr, and few enough digits
    that float32 noise between machines (a relative 1e-7) does not show.
    """
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, str):
        return NONFINITE_TEXT.get(x, x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "+Inf" if x > 0 else "−Inf"
        if x == 0:
            return "0"
        return f"{x:.{digits}g}"
    return str(x)
