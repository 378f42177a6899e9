"""What the confined child sends back, checked before anything of it is shown: nothing from the child is trusted.

    checked_tree(d)        -> None, or why `d` is not a result this process will render
    analysis_problem(d)    -> None, or why `d` is not an analysis (the contract's required keys and their types)
    sanitize_tree(d)       -> a copy of `d` whose every string is capped and shows no control or bidi character

Strings go through the same sanitiser as a snapshot's strings (nanreplay/sanitize.py); the renderers then escape
for the terminal, HTML and Markdown as they do for any snapshot string.
"""

from __future__ import annotations

import math

from nanreplay.sanitize import cap, html_visible

MAX_DEPTH = 64  # nesting of dicts and lists (the analysis nests about 10 deep)
MAX_ITEMS = 4_000_000  # values in all
MAX_STRING = 1 << 20  # characters of one string (a code context, a traceback)
SHOWN_STRING = 64 << 10  # characters of one string kept for the renderers
# The contract's required keys and their types (DESIGN.md: fields are added, never renamed).
REQUIRED = {"schema": str, "snapshot": str, "verdict": str, "diagnosis": dict, "environment": dict, "stats": dict}
OPTIONAL = {"culprit": (dict, type(None)), "failure": (dict, type(None)), "warnings": (list, type(None)),
            "chain": (list, dict, type(None)), "nonfinite_leaves": (list, type(None)),
            "differential": (dict, type(None)), "precision": (list, dict, type(None)), "model": (dict, type(None))}


def checked_tree(d: object) -> str | None:
    """None where `d` is a JSON tree of bounded depth, size and string length with string keys and finite
    numbers; otherwise what is wrong (one short phrase)."""
    stack = [(d, 0)]
    seen = 0
    while stack:
        x, depth = stack.pop()
        seen += 1
        if seen > MAX_ITEMS:
            return f"more than {MAX_ITEMS} values"
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH}"
        if isinstance(x, dict):
            for k, v in x.items():
                if not isinstance(k, str) or len(k) > 1000:
                    return "a key that is not a short string"
                stack.append((v, depth + 1))
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)
        elif isinstance(x, str):
            if len(x) > MAX_STRING:
                return f"a string of more than {MAX_STRING} characters"
        elif isinstance(x, float):
            if not math.isfinite(x):
                return "a non-finite number"
        elif not (x is None or isinstance(x, (bool, int))):
            return f"a {type(x).__name__}"
    return None


def analysis_problem(d: dict) -> str | None:
    """None where `d` has the contract's required keys with their types (and the known optional ones typed)."""
    why = checked_tree(d)
    if why:
        return why
    for k, t in REQUIRED.items():
        if not isinstance(d.get(k), t):
            return f"its {k!r} is not a {t.__name__}"
    for k, ts in OPTIONAL.items():
        if k in d and not isinstance(d[k], ts):
            return f"its {k!r} has the wrong type"
    return None


def sanitize_tree(x: object) -> object:
    """A copy with every string (keys too) capped at SHOWN_STRING characters and every control character but tab
    and newlines, and every bidi override, made visible ([U+001B]): no escape sequence reaches a terminal from the
    child, whichever renderer shows it."""
    if isinstance(x, str):
        return html_visible(cap(x, SHOWN_STRING))
    if isinstance(x, dict):
        return {sanitize_tree(k): sanitize_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [sanitize_tree(v) for v in x]
    return x
