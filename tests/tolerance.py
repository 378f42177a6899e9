"""What a test may assert about a number an analysis computed, and how the tests compare whole analyses.

Float32 sums and matmuls are not bit-stable across CPUs, math-library code paths (ATen's vectorised kernels:
ATEN_CPU_CAPABILITY; oneDNN: ONEDNN_MAX_CPU_ISA; MKL: MKL_CBWR, MKL_ENABLE_INSTRUCTIONS) or thread counts: a
reduced or matmul value agrees to a relative `REL`, never to its last digit (.ci/run runs the suite under a
lower code path too). Counts,
shapes, dtypes, indices and line numbers are exact. Prose writes a measured number with `stats.num`
(4 significant digits), so its text compares exactly up to a rounding boundary (`same_text`).
"""

from __future__ import annotations

import json
import math
import re

REL = 1e-4  # float32 reductions and matmuls agree to this across CPUs, BLAS code paths and thread counts
CODE = {"code", "before", "after", "lines", "call"}  # keys whose strings are code: character for character
# a number as prose writes it: digits with an optional fraction and exponent, not part of a word (float32, 0.1.0)
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d+|\d+)(?:e[-+]?\d+)?(?!\w|\.\d)")
MIN_DIGITS = 3  # a number shown with fewer significant digits is a chosen constant: exact
RAW_DIGITS = 9  # a float32 value's repr as a Python float has 16-17 significant digits; prose writes at most 8


def close(a: float, b: float, rel: float = REL) -> bool:
    """Equal as a float32 reduction or matmul guarantees on another machine."""
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


def _significant(token: str) -> int:
    mantissa = re.split(r"e", token.lstrip("+-"))[0].replace(".", "").lstrip("0")
    return len(mantissa)


def _same_shown_number(a: str, b: str) -> bool:
    """Two numbers as prose shows them: equal, or (shown with 3 or more significant digits and a decimal
    point or exponent) one unit apart in the last digit shown: two machines' values, a relative 1e-5
    apart, may straddle a rounding boundary. Integers (counts, indices, lines) and numbers shown with
    fewer digits (chosen constants: eps = 1e-6, lr = 0.01) must be equal."""
    if a == b:
        return True
    if not all(("." in t or "e" in t) and _significant(t) >= MIN_DIGITS for t in (a, b)):
        return False
    x, y = float(a), float(b)
    exp = math.floor(math.log10(max(abs(x), abs(y)))) if x or y else 0
    unit = 10.0 ** (exp - max(_significant(a), _significant(b)) + 1)
    return abs(x - y) <= unit * 1.01


def same_text(a: str, b: str) -> bool:
    """Prose: every character outside the numbers equal, the numbers as `_same_shown_number`."""
    if a == b:
        return True
    if NUMBER.split(a) != NUMBER.split(b):
        return False
    ta, tb = NUMBER.findall(a), NUMBER.findall(b)
    return len(ta) == len(tb) and all(_same_shown_number(x, y) for x, y in zip(ta, tb, strict=True))


def same(golden, fresh, where: str = "", key: str | None = None) -> list[str]:
    """Where `fresh` differs from `golden` beyond what a different machine may change, one line per place.

    Exact: every key, every list's length, bools, None, integers (counts, shapes, indices, lines), and the
    text of every string: code (`CODE`) character for character, prose outside its numbers. A float and a
    number inside prose: to the relative `REL` (a float) or one unit in the last digit shown (prose).
    """
    at = where or "(top)"
    if isinstance(golden, dict) and isinstance(fresh, dict):
        out = [f"{where}.{k}: missing now" for k in sorted(golden.keys() - fresh.keys())]
        out += [f"{where}.{k}: new (not in the golden file)" for k in sorted(fresh.keys() - golden.keys())]
        for k in sorted(golden.keys() & fresh.keys()):
            out += same(golden[k], fresh[k], f"{where}.{k}", k)
        return out
    if isinstance(golden, list) and isinstance(fresh, list):
        if len(golden) != len(fresh):
            return [f"{at}: {len(golden)} elements in the golden file, {len(fresh)} now"]
        return [d for i, (g, f) in enumerate(zip(golden, fresh, strict=True)) for d in same(g, f, f"{where}[{i}]", key)]
    if type(golden) is float and type(fresh) is float:
        ok = close(golden, fresh)
    elif isinstance(golden, str) and isinstance(fresh, str):
        ok = golden == fresh if key in CODE else same_text(golden, fresh)
    else:  # ints, bools, None, and any change of type: exactly
        ok = type(golden) is type(fresh) and golden == fresh
    return [] if ok else [f"{at}: golden {json.dumps(golden, ensure_ascii=False)}, now {json.dumps(fresh, ensure_ascii=False)}"]


def unrounded(x, key: str | None = None) -> list[str]:
    """Every prose string of an analysis JSON that writes a number as a raw repr (-16.13626480102539):
    prose must format measured numbers with `stats.num`, or it reads badly and differs between machines."""
    if isinstance(x, dict):
        return [s for k, v in x.items() for s in unrounded(v, k)]
    if isinstance(x, list):
        return [s for v in x for s in unrounded(v, key)]
    if isinstance(x, str) and key not in CODE and any(_significant(t) >= RAW_DIGITS and ("." in t or "e" in t)
                                                               for t in NUMBER.findall(x)):
        return [x]
    return []
