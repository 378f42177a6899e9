"""Rendering an analysis: the HTML report, the terminal summary.

    gather_sources()   the one step that reads files: the source lines the report quotes
    build_view()       the analysis as view models, one per section (report.views)
    render_html()      gather, build, lay out with the template (report.html)
    terminal_summary() the banner in a few lines (culprit_block(): its first lines, known after the replay)
    markdown_summary() the banner as Markdown, to paste into a ticket
"""

from __future__ import annotations

from nanreplay.report.format import module_label, num
from nanreplay.report.html import render_html, write_report
from nanreplay.report.markdown import markdown_summary
from nanreplay.report.page import ReportView, build_view
from nanreplay.report.sources import gather_sources
from nanreplay.report.terminal import coloured, culprit_block, terminal_lines, terminal_summary
from nanreplay.report.views.source import SourceLine

__all__ = ["ReportView", "SourceLine", "build_view", "coloured", "culprit_block", "gather_sources", "markdown_summary",
           "module_label", "num", "render_html", "terminal_lines", "terminal_summary", "write_report"]
