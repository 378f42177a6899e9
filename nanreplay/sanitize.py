"""Strings from a snapshot, made safe to show: on a terminal (one line, no escape sequences) and in HTML.

A snapshot may come from a stranger, and every string in it — module names, file
paths, code lines, error messages — may carry control characters: an escape sequence
that clears the screen, sets the window title or writes the clipboard (OSC 52), a
newline that forges a second "nanreplay: ..." line, or a bidi override (U+202E) that
makes code read differently from what it is. Here they are escaped, visibly:

    terminal(text)          every control and bidi character as a Python-style escape
    one_line(text, limit)   the same, on one line, at most `limit` characters (an ellipsis marks the cut)
    cap(text, limit)        at most `limit` characters, an ellipsis marking the cut (no escaping)
    html_visible(text)      bidi and control characters as visible [U+XXXX] (HTML escaping is jinja's job)
"""

from __future__ import annotations

import re

ELLIPSIS = "…"
TERMINAL_LIMIT = 1000  # characters of one terminal line that quotes a snapshot's string
DISPLAY_LIMIT = 4000  # characters of any one string a report shows

# Bidirectional formatting characters: they reorder how text around them is displayed
# (the "Trojan Source" characters), plus the line and paragraph separators.
_BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_SEPARATORS = "\u2028\u2029"
# C0 controls, DEL, C1 controls: escape sequences start with ESC (\x1b) or CSI (\x9b).
_CONTROL = "".join(map(chr, [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]))
_TERMINAL_UNSAFE = re.compile(f"[{re.escape(_CONTROL + _BIDI + _SEPARATORS)}]")
_HTML_UNSAFE = re.compile(f"[{re.escape(_CONTROL.replace(chr(9), '').replace(chr(10), '').replace(chr(13), ''))}"
                          f"{re.escape(_BIDI + _SEPARATORS)}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    ch = m.group()
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal(text: object) -> str:
    """`text` with every control character (newlines included) and bidi override escaped: `\\x1b`, `\\n`, `\\u202e`."""
    return _TERMINAL_UNSAFE.sub(_escape, str(text))


def cap(text: str, limit: int = DISPLAY_LIMIT) -> str:
    """At most `limit` characters; a longer text is cut and ends with an ellipsis (and says how much was cut)."""
    if limit <= 0 or len(text) <= limit:
        return text
    note = f"{ELLIPSIS} [{len(text) - limit:,} more characters]"
    keep = max(0, limit - len(note))
    return text[:keep] + note if keep else text[:limit - 1] + ELLIPSIS


def one_line(text: object, limit: int = TERMINAL_LIMIT) -> str:
    """`text` made safe for one terminal line: escaped (see `terminal`), then capped at `limit` characters."""
    return cap(terminal(text), limit)


def html_visible(text: str) -> str:
    """Bidi overrides, separators and control characters (tab and newlines excepted) as visible `[U+202E]`."""
    return _HTML_UNSAFE.sub(lambda m: f"[U+{ord(m.group()):04X}]", text)


def cap_strings(obj: object, limit: int = DISPLAY_LIMIT) -> object:
    """A copy of a JSON-like value (dicts, lists, tuples) with every string — keys too — capped at `limit`."""
    if isinstance(obj, str):
        return cap(obj, limit)
    if isinstance(obj, dict):
        return {cap_strings(k, limit) if isinstance(k, str) else k: cap_strings(v, limit) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cap_strings(v, limit) for v in obj]
    if isinstance(obj, tuple):
        return tuple(cap_strings(v, limit) for v in obj)
    return obj
