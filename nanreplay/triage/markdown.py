"""A triage run as a short Markdown summary, to paste into a ticket: the groups as a table, the failures counted."""

from __future__ import annotations

MAX_GROUPS = 15
MAX_FAILURES = 10


def markdown_summary(doc: dict) -> str:
    """groups.json's document as Markdown: the one summary line, a row per root cause, the files not analyzed."""
    from nanreplay.report.markdown import code, escape
    from nanreplay.triage.index import index_view

    v = index_view(doc)

    def cell(text: str) -> str:  # inside a table cell a pipe ends the cell, even in a code span
        return text.replace("|", "\\|")

    out = [f"**nanreplay triage** {code(doc['dir'])}: {escape(', '.join(p.text for p in v['summary']))}", ""]
    groups = v["groups"]
    if groups:
        out += ["| # | snapshots | root cause | where | steps | fix |", "|---:|---:|---|---|---|---|"]
        for g in groups[:MAX_GROUPS]:
            where = f"{code(g.where)} {code(g.code)}" if g.where else "—"
            cause = escape(g.cause) + (f" ({escape(g.culprit)})" if g.culprit else "")
            fix = f"{escape(g.fix)}, {escape(g.verified)}" if g.fix else "—"
            out.append(f"| {g.number} | {g.count} | {cell(cause)} | {cell(where)} | {escape(g.steps)} | {cell(fix)} |")
        if len(groups) > MAX_GROUPS:
            out.append(f"\n… and {len(groups) - MAX_GROUPS} more groups (see index.html).")
    machines = doc.get("machines")
    if machines and machines["transient"]:
        out += ["", f"**Transient failures per machine** ({machines['transient']} of {machines['checked']} checked):"]
        out += [f"- {escape(m['sentence'])}" for m in machines["devices"][:MAX_FAILURES] if m["transient"]]
    failures = v["failures"]
    if failures:
        out += ["", f"**Not analyzed ({len(failures)}):**"]
        out += [f"- {code(f['file'])}: {escape(f['label'])}: {escape(f['reason'])}" for f in failures[:MAX_FAILURES]]
        if len(failures) > MAX_FAILURES:
            out.append(f"- … and {len(failures) - MAX_FAILURES} more (see index.html)")
    return "\n".join(out) + "\n"
