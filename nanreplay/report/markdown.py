"""The analysis as a short Markdown summary, to paste into a GitHub/GitLab/Jira ticket.

Trackers do not render an attached HTML report inline; this is the part people read in
the ticket itself: the verdict, the user's line, what happened there, why, the fix as a
diff, the anomaly-mode answer and the environment in one line. It is built from the same
`Banner` as the page and the terminal summary, so the three say the same thing.

Every string that came from a snapshot (module and parameter names, paths, code) is
either inside a code span or block whose fence it cannot close, or escaped: a snapshot
cannot add links, images, HTML or formatting to the ticket.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from nanreplay.analysis.result import Analysis
from nanreplay.report.format import Seg
from nanreplay.report.views.banner import Banner, anomaly_short, banner, failure_text
from nanreplay.report.views.compiler import compiler_line
from nanreplay.report.views.environment import environment_line
from nanreplay.report.views.kernel import kernel_line
from nanreplay.report.views.machine import machine_view

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u202a-\u202e\u2066-\u2069]")
_SPECIAL = re.compile(r"([\\`*_\[\]<>|~@])")  # what could format, link, mention or open HTML mid-line


def clean(text: str) -> str:
    """No control characters (terminal escapes, bidi overrides) and no line breaks: one line of text."""
    return re.sub(r"\s+", " ", _CONTROL.sub("", str(text)))


def escape(text: str) -> str:
    """Plain text that Markdown shows as written: every character that could format, link or open HTML escaped."""
    return _SPECIAL.sub(r"\\\1", clean(text))


def code(text: str) -> str:
    """An inline code span that holds `text` whatever backticks it contains."""
    text = clean(text).strip()
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def block(text: str, lang: str = "") -> str:
    """A fenced code block that `text` cannot close."""
    text = "\n".join(_CONTROL.sub("", ln).rstrip() for ln in str(text).splitlines())
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=2)
    fence = "`" * (longest + 1)
    return f"{fence}{lang}\n{text}\n{fence}"


WIDTH = 88  # a GitHub comment shows about this many characters of a code block before it scrolls


def wrap_comments(code: str, width: int = WIDTH) -> str:
    """Code whose long comment lines (a fix given as advice: `# run the step in bfloat16 ...`) are wrapped into
    several comment lines, so a ticket shows them without scrolling. Code itself is never re-wrapped."""
    out = []
    for line in code.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("#") and len(line) > width:
            indent = line[:len(line) - len(stripped)]
            prefix = indent + "# "
            out += textwrap.wrap(stripped.lstrip("#").strip(), width=width, initial_indent=prefix,
                                 subsequent_indent=prefix, break_long_words=False, break_on_hyphens=False)
        else:
            out.append(line)
    return "\n".join(out)


def prose(segs: list[Seg]) -> str:
    return "".join(code(s.text) if s.code else escape(s.text) for s in segs)


def _fix_lines(b: Banner) -> list[str]:
    f = b.fix
    if f is None:
        return [f"**Fix:** {escape(b.no_fix)}"] if b.no_fix else []
    badge = f.badge.text
    out = [f"**Fix** ({escape(f.label)}), {escape(badge)}:"]
    if f.diff:
        out.append(block("\n".join(f"@@ {dl.text} @@" if dl.sign == "@" else f"{'-' if dl.sign == '-' else '+'} {dl.text}"
                                   for dl in f.diff), "diff"))
    elif f.code:
        out.append(block(wrap_comments(f.code), "python"))
    if f.badge.tone != "ok" and f.verification:
        out.append(f"({escape(f.verification)})")
    return out


def markdown_summary(a: Analysis | dict) -> str:
    """The verdict, the culprit's line with its code, the cause, the fix as a diff, anomaly mode, the environment."""
    d = a.to_json() if isinstance(a, Analysis) else a
    b = banner(d)
    c = d.get("culprit")
    title = f"**nanreplay: {escape(b.verdict_label)}**" + (f" — {escape(b.cause)}" if b.cause else "")
    out = [title, ""]
    if c:
        src = c.get("source")
        if b.line:
            fn = f" in {code(b.line.function + '()')}" if b.line.function else ""
            out += [f"{code(b.line.where)}{fn}:", block(b.line.code, "python")]
        elif src is None:
            out.append(f"Where: {escape(next((f.value for f in b.facts if f.label == 'source'), ''))}.")
        what = f"{escape(b.headline)} ({code(c.get('op') or '')}"
        what += f" in {code(c['backward_node'])})" if c.get("backward_node") else ")"
        if c.get("module") not in (None, "", "<loss>"):
            what += f" in module {code(c['module'])}"
        fail = failure_text(d)
        out.append(what + (f"; {escape(fail)}." if fail else "."))
    else:
        flow = d.get("verdict") in ("gradient_cut", "gradient_zero")
        if flow and b.line:  # where the gradient's flow ends
            out += [f"{code(b.line.where)}:", block(b.line.code, "python")]
        out.append(escape(b.headline) + (f" ({code(b.subline)})" if flow and b.subline else "") + ".")
        for r in (d.get("nonfinite_leaves") or [])[:5]:
            out.append(f"- {code(r.get('name') or '')} ({escape(r.get('role') or '')}): {escape(str(r.get('nan', 0)))} NaN, "
                       f"{escape(str(r.get('inf', 0)))} Inf")
    machine = machine_view(d)
    if machine is not None and machine.first_screen:
        out += ["", f"**Machine:** {escape(machine.sentence)}"]
    if b.why:  # a dead gradient's details (the checkpoint, the share of dead units, the history) are its why
        rest = f" {prose(b.details)}" if d.get("verdict") in ("gradient_cut", "gradient_zero") and b.details else ""
        out += ["", f"**Why:** {prose(b.why)}{rest}"]
    for bc in [x for x in d.get("broadcast") or [] if isinstance(x, dict)][:3]:  # a silent shape bug, always said
        src = bc.get("source") if isinstance(bc.get("source"), dict) else None
        at = f"{code(str(src.get('file')) + ':' + str(src.get('line')))}: " if src else ""
        out += ["", f"**Shape bug:** {at}{escape(str(bc.get('message') or ''))}"]
    fix = _fix_lines(b)
    if fix:
        out += ["", *fix]
    compiled = compiler_line(d)
    if compiled:
        out += ["", f"**Compiled replay:** {escape(compiled)}."]
    kl = kernel_line(d)
    if kl:
        out += ["", f"**Kernel replay:** {escape(kl)}."]
    am = anomaly_short(d)
    if am:
        out += ["", f"**Anomaly detection:** {code('set_detect_anomaly(True)')} {escape(am)}."]
    snap = Path(str(d.get("snapshot") or "snapshot.pt")).name
    out += ["", f"*Environment* — {escape(environment_line(d))} · nanreplay {escape(d.get('nanreplay_version') or '')}"
                f" · {code(snap)}"]
    return "\n".join(out) + "\n"

