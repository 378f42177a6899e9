"""index.html, the page of a triage run: the groups, the ranks and the failures, as a view and rendered."""

from __future__ import annotations

from datetime import datetime, timezone


def _steps(first: int | None, last: int | None) -> str:
    if first is None:
        return "—"
    return str(first) if first == last else f"{first}–{last}"


def _module(m: str | None) -> str:
    if m is None:
        return "—"
    return m or "<root>"


def index_view(doc: dict) -> dict:
    """Everything index.html shows, as plain data; the template only lays it out."""
    groups = []
    for g in doc["groups"]:
        fix = g["fix"]
        groups.append({**g, "steps": _steps(g["first_step"], g["last_step"]),
                       "module_label": _module(g["module"]),
                       "ranks_label": ", ".join(map(str, g["ranks"])) or "—",
                       "verified_label": f"verified by replay in {fix['verified']} of {fix['of']}" if fix["verified"]
                       else ("not verified" if fix["not_verified"] else "not verifiable"),
                       "show_fix": bool(fix["kind"] and fix["kind"] != "none" and fix["code"])})
    titles = {g["id"]: g["title"] or g["cause"] or g["verdict"] for g in doc["groups"]}
    numbers = {g["id"]: i for i, g in enumerate(doc["groups"], 1)}
    return {"title": f"nanreplay triage: {doc['dir']}", "doc": doc, "groups": groups, "titles": titles,
            "numbers": numbers, "failures": doc["failures"], "ranks": doc["ranks"], "ignored": doc["ignored"],
            "ignored_shown": doc["ignored"][:50], "ignored_more": max(0, len(doc["ignored"]) - 50),
            "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def render_index(doc: dict) -> str:
    from nanreplay.report.html import jinja_env

    return jinja_env().get_template("triage.html.j2").render(**index_view(doc))
