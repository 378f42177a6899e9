"""Rendering an analysis: the HTML report, the terminal summary (see docs/architecture.md)."""

from __future__ import annotations

from nanreplay.report.html import build_view, render_html, terminal_summary, write_report

__all__ = ["build_view", "render_html", "terminal_summary", "write_report"]
