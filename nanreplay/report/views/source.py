"""The source section: the culprit's line in its file, with a small Python highlighter for the lines shown."""

from __future__ import annotations

import re
from dataclasses import dataclass

from nanreplay.report.format import loss_name, where
from nanreplay.report.sources import SOURCE_CONTEXT, Sources, excerpt, upstream_event


@dataclass
class Token:
    text: str
    cls: str  # "" | kw | str | num | com | fn


@dataclass
class SourceLine:
    number: int | None
    tokens: list[Token]
    mark: str  # "" | "culprit" | "anomaly" | "upstream"


@dataclass
class SourceView:
    file: str
    line: int | None
    function: str
    lines: list[SourceLine]
    origin: str  # file | recorded | none
    note: str
    note_first: bool = False  # the note explains what the lines are (no line of the culprit's own)


_PY_TOKEN = re.compile(
    r"(?P<com>#.*)"
    r"|(?P<str>[rbuRBUfF]{0,2}(?:'''.*?'''|\"\"\".*?\"\"\"|'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"))"
    r"|(?P<num>\b\d[\d_]*(?:\.\d*)?(?:[eE][+-]?\d+)?\b|\.\d+(?:[eE][+-]?\d+)?)"
    r"|(?P<word>[A-Za-z_]\w*)"
)
_KEYWORDS = frozenset(
    "False None True and as assert async await break class continue def del elif else except finally for from "
    "global if import in is lambda nonlocal not or pass raise return try while with yield".split())


def highlight_python(line: str) -> list[Token]:
    """One line of Python as tokens for colouring: keywords, strings, numbers, comments, calls.

    Per line and regex-based on purpose: a few lines cut out of a file rarely tokenize
    as complete Python, and this only colours — it never hides text.
    """
    out: list[Token] = []
    pos = 0
    for m in _PY_TOKEN.finditer(line):
        if m.start() > pos:
            out.append(Token(line[pos:m.start()], ""))
        kind = m.lastgroup or ""
        text = m.group()
        if kind == "word":
            kind = "kw" if text in _KEYWORDS else ("fn" if line[m.end():m.end() + 1] == "(" else "")
        out.append(Token(text, kind))
        pos = m.end()
    if pos < len(line):
        out.append(Token(line[pos:], ""))
    return out


def _context(text: dict[int, str] | None, line: int | None, extra: int | None = None) -> list[tuple[int, str]] | None:
    """The recorded line with SOURCE_CONTEXT lines around it (and `extra`, when it is near), from what was read."""
    if not text or line is None or line not in text:  # lines that do not hold the line are not its context
        return None
    lo = max(1, line - SOURCE_CONTEXT)
    hi = min(max(text), line + SOURCE_CONTEXT)
    if extra is not None and abs(extra - line) <= 2 * SOURCE_CONTEXT and extra in text:
        lo, hi = min(lo, extra), max(hi, extra)
    return [(i, text[i].rstrip()) for i in range(lo, hi + 1) if i in text]


def _common_indent(lines: list[str]) -> int:
    ind = [len(s) - len(s.lstrip()) for s in lines if s.strip()]
    return min(ind) if ind else 0


def source_view(d: dict, sources: Sources) -> SourceView | None:
    """The culprit's line in its file (or, without one, the user's line upstream of it), highlighted and marked."""
    c = d.get("culprit")
    if not c:
        return None
    src = c.get("source")
    if not src:
        if c.get("module") == "<loss>":
            loss, named = loss_name(d)
            what = f"the loss function you named with --loss {loss}" if named else \
                f"the loss function, {loss}" if loss else "the loss function"
            note = (f"The culprit {c.get('op')} ran inside {what}: library code, not yours, so there is no source "
                    "line of yours to show for it.")
        else:
            note = ("No source line of yours was recorded for this op: it ran inside library code (or an exported "
                    "program without stack traces). The module path and the chain below locate it.")
        e = upstream_event(d)
        if e is None:
            if c.get("module") == "<loss>":
                note += (" What reached the loss is in the inputs table below; the fix is usually upstream (the "
                         "model's output) or a numerically safer loss.")
            return SourceView("", None, "", [], "none", note, note_first=True)
        usrc = e["source"]
        ctx = _context(excerpt(sources, usrc), usrc.get("line"))
        note += (f" The non-finite values it received come from your line {where(usrc)} "
                 f"({e.get('role')} {e.get('op')}), shown here.")
        if ctx:
            strip = _common_indent([t for _, t in ctx])
            lines = [SourceLine(i, highlight_python(t[strip:]), "upstream" if i == usrc.get("line") else "")
                     for i, t in ctx]
        else:
            lines = [SourceLine(usrc.get("line"), highlight_python(str(usrc.get("code") or "").strip()), "upstream")]
        return SourceView(str(usrc.get("file")), usrc.get("line"), usrc.get("function") or "", lines,
                          "file" if ctx else "recorded", note, note_first=True)
    line = src.get("line")
    am = d.get("anomaly_mode") or {}
    am_src = am.get("source") if am.get("raises") and not am.get("agrees_with_culprit") else None
    am_line = am_src.get("line") if am_src and am_src.get("path") == src.get("path") and \
        am_src.get("line") != line else None
    ctx = _context(excerpt(sources, src), line, am_line)
    if ctx:
        strip = _common_indent([t for _, t in ctx])
        lines = [SourceLine(i, highlight_python(t[strip:]),
                            "culprit" if i == line else ("anomaly" if i == am_line else "")) for i, t in ctx]
        note = "" if not am_line or not any(s.mark == "anomaly" for s in lines) else \
            f"Line {am_line} is where set_detect_anomaly(True) would have pointed instead."
        return SourceView(str(src.get("file")), line, src.get("function") or "", lines, "file", note)
    code = src.get("code") or ""
    note = ("The source file is not readable now (or has changed since the analysis); this is the line as recorded "
            "when the step was replayed.") if code else "The source line could not be read."
    lines = [SourceLine(line, highlight_python(str(code).strip()), "culprit")] if code else []
    return SourceView(str(src.get("file")), line, src.get("function") or "", lines, "recorded", note)
