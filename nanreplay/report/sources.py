"""The one step of the report that reads local files: the source lines it quotes.

`gather_sources()` runs before the views are built (`render_html` calls it) and reads
the files the source section may quote; the view builders then only look lines up in
what it returned. Which files are read:

* the culprit's recorded source line, when it has one;
* otherwise the first chain event with a source line of the user's, preferring the
  event where the non-finite value entered (a literal, an origin or a conversion).

The lines come from the analysis itself wherever it has them (`source["context"]`: for a
snapshot, the lines recorded at capture time). A file is read only when the analysis marked
it readable (`source["path"]`: code that ran in this process, or a local copy of a recorded
file under a folder the user allowed whose line matches), and only a .py file of sane size
whose line still says what was recorded. A snapshot cannot make the report quote a file.
"""

from __future__ import annotations

from pathlib import Path

from nanreplay.analysis.result import Analysis

SOURCE_CONTEXT = 3  # lines shown above and below the recorded line
MAX_SOURCE_BYTES = 2_000_000  # never read a bigger "source file" for context

# (path, line) of a recorded source -> {line number: text} of the file around it: up to
# 2 × SOURCE_CONTEXT lines either side, so a second marked line near it can be shown too.
Sources = dict[tuple[str, int], dict[int, str]]


def source_key(src: dict) -> tuple[str, int] | None:
    """The key a recorded source dict has in `Sources`; None when it names no file and line."""
    path, line = src.get("path") or src.get("file"), src.get("line")
    return (path, line) if isinstance(path, str) and isinstance(line, int) else None


def recorded_excerpt(src: dict) -> dict[int, str] | None:
    """The context lines the analysis carries for `src` (no file is read)."""
    ctx = src.get("context")
    if not isinstance(ctx, dict) or not isinstance(ctx.get("start"), int) or not isinstance(ctx.get("lines"), list):
        return None
    return {ctx["start"] + i: str(text) for i, text in enumerate(ctx["lines"])}


def excerpt(sources: Sources, src: dict) -> dict[int, str] | None:
    """What `gather_sources` read for `src`, or None."""
    key = source_key(src)
    return sources.get(key) if key is not None else None


def upstream_event(d: dict) -> dict | None:
    """For a culprit without a line of the user's: the chain's first event that has one (where its input came from)."""
    with_src = [e for e in d.get("chain") or [] if e.get("source")]
    return next((e for e in with_src if e.get("role") in ("literal", "origin", "conversion")), None) or \
        next(iter(with_src), None)


def quoted_sources(d: dict) -> list[dict]:
    """The recorded source dicts whose files the report may quote (see the module docstring)."""
    c = d.get("culprit")
    if not c:
        return []
    if c.get("source"):
        return [c["source"]]
    e = upstream_event(d)
    return [e["source"]] if e else []


def gather_sources(analysis_json: Analysis | dict) -> Sources:
    """Read the lines around every source the report may quote; a file that is not fit to quote is left out."""
    d = analysis_json.to_json() if isinstance(analysis_json, Analysis) else analysis_json
    out: Sources = {}
    for src in quoted_sources(d):
        text = read_excerpt(src)
        key = source_key(src)
        if text is not None and key is not None:
            out[key] = text
    return out


def read_excerpt(src: dict) -> dict[int, str] | None:
    """The lines around `src`'s line: the recorded context, else read from the file the analysis marked
    readable; None when there is neither."""
    recorded = recorded_excerpt(src)
    if recorded is not None:
        return recorded
    path, line = src.get("path"), src.get("line")
    if not isinstance(path, str) or not isinstance(line, int):
        return None
    if line < 1 or not path.endswith(".py"):
        return None
    p = Path(path)
    try:
        if not p.is_file() or p.stat().st_size > MAX_SOURCE_BYTES:
            return None
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
    except (OSError, ValueError):
        return None
    if line > len(lines):
        return None
    code = src.get("code")
    if code and lines[line - 1].strip() != str(code).strip():
        return None  # the file changed since the analysis: the recorded line is the truth
    lo, hi = max(1, line - 2 * SOURCE_CONTEXT), min(len(lines), line + 2 * SOURCE_CONTEXT)
    return {i: lines[i - 1] for i in range(lo, hi + 1)}
