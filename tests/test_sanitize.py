"""nanreplay.sanitize: what reaches a terminal is one line with no live control sequence; HTML shows bidi overrides."""

from __future__ import annotations

from nanreplay.sanitize import cap, cap_strings, html_visible, one_line, terminal

CLEAR = "\x1b[2J\x1b[H"
TITLE = "\x1b]0;owned\x07"
CLIPBOARD = "\x1b]52;c;ZWNobyBwd25lZA==\x07"  # OSC 52: write the clipboard
CSI8 = "\x9b31m"  # the one-byte CSI of C1


def test_terminal_escapes_every_control_sequence_visibly():
    text = f"mod{CLEAR}{TITLE}{CLIPBOARD}{CSI8}\x7f.fc"
    out = terminal(text)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in out), out
    assert out == ("mod\\x1b[2J\\x1b[H\\x1b]0;owned\\x07\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\x9b31m\\x7f.fc")


def test_a_newline_cannot_forge_a_second_line():
    out = one_line("boom\nnanreplay: analysis OK\r\n\tdone")
    assert "\n" not in out and "\r" not in out
    assert out == "boom\\nnanreplay: analysis OK\\r\\n\\tdone"


def test_bidi_overrides_are_escaped_for_the_terminal_and_visible_in_html():
    trojan = "access = 'user\u202e \u2066// admin\u2069\u2066'"
    assert "\u202e" not in terminal(trojan) and "\\u202e" in terminal(trojan) and "\\u2066" in terminal(trojan)
    shown = html_visible(trojan)
    assert "[U+202E]" in shown and "[U+2066]" in shown and "[U+2069]" in shown
    assert not any(c in shown for c in "\u202e\u2066\u2069")
    assert html_visible("line\n\tnext") == "line\n\tnext"  # layout characters stay
    assert html_visible("a\x1bb") == "a[U+001B]b"
    assert terminal("naïve → ∞ 日本") == "naïve → ∞ 日本"  # ordinary non-ASCII text is untouched


def test_caps_end_with_an_ellipsis_and_say_how_much_was_cut():
    s = "x" * 2_000_000
    c = cap(s, 1000)
    assert len(c) == 1000 and "…" in c and "more characters" in c
    assert cap("short", 1000) == "short"
    assert len(one_line(s, 80)) == 80
    assert len(one_line("\x1b" * 1000, 50)) == 50  # the cap counts the escaped text
    assert cap("abcdef", 3) == "ab…"


def test_cap_strings_walks_json_values():
    doc = {"a": ["y" * 10_000, {"k" * 9000: ("z" * 5000, 3)}], "n": 1.5, "none": None}
    out = cap_strings(doc, 100)
    assert len(out["a"][0]) == 100 and out["n"] == 1.5 and out["none"] is None
    (key, val), = out["a"][1].items()
    assert len(key) == 100 and isinstance(val, tuple) and len(val[0]) == 100 and val[1] == 3
    assert len(doc["a"][0]) == 10_000  # the input is not changed
