"""index.html, the page of a triage run: the groups as one compact sortable table, the ranks, the failures.

Compute first, render second (coverage.py's index is the model): `index_view()` turns
groups.json's document into rows of plain strings and links; the template only lays them
out. The page carries the same Content-Security-Policy as a report (nothing from the
network, only its own style and script, pinned by hash) and the report's table sorter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

MAX_LINKS = 3  # a group lists this many reports inline; more are folded
MAX_IGNORED = 50


@dataclass
class Link:
    text: str
    href: str = ""  # "" for plain text
    note: str = ""


@dataclass
class GroupRow:
    number: int
    id: str
    count: int
    cause: str  # the diagnosis' title, in words
    cause_id: str  # the identifier (sqrt_at_zero), for the tooltip and scripts
    verdict: str
    culprit: str  # "the gradient of sqrt made Inf in backward"
    op: str  # "aten.div.Tensor in SqrtBackward0"
    module: str
    where: str  # file:line
    code: str
    steps: str
    first_step: int | None
    ranks: str
    fix: str  # "add an epsilon"
    fix_code: str
    verified: str  # "verified 12 of 12" / "did not verify" / ""
    verified_tone: str  # ok | bad | muted
    reports: list[Link] = field(default_factory=list)
    more_reports: list[Link] = field(default_factory=list)


def _steps(first: int | None, last: int | None) -> str:
    if first is None:
        return "—"
    return str(first) if first == last else f"{first}–{last}"


def _group_row(n: int, g: dict) -> GroupRow:
    from nanreplay.report.format import fix_label, module_label
    from nanreplay.report.views.banner import culprit_sentence

    fix = g["fix"]
    culprit, op = ("", "")
    if g.get("op"):
        culprit, op = culprit_sentence({"op": g["op"], "phase": g.get("phase"), "kind": g.get("kind"),
                                        "forward_op": g.get("forward_op"), "backward_node": g.get("backward_node"),
                                        "module": g.get("module"),
                                        "output": {"posinf": "+" in (g.get("inf_sign") or ""),
                                                   "neginf": "-" in (g.get("inf_sign") or "")}})
    if fix["verified"]:
        verified, tone = f"✓ verified in {fix['verified']} of {fix['of']}", "ok"
    elif fix["not_verified"]:
        verified, tone = "✗ did not verify", "bad"
    else:
        verified, tone = "not verified", "muted"
    show_fix = bool(fix["kind"] and fix["kind"] != "none" and fix["code"])
    src = g.get("source") or {}
    links = []
    for s in g["snapshots"]:
        note = " · ".join(x for x in (f"step {s['step']}" if s.get("step") is not None else "",
                                      f"rank {s['rank']}" if s.get("rank") is not None else "",
                                      f"same bytes as {s['duplicate_of']}" if s.get("duplicate_of") else "") if x)
        links.append(Link(str(s["file"]), str(s["report"]), note))
    return GroupRow(
        number=n, id=g["id"], count=g["count"], cause=g.get("title") or g.get("cause") or g["verdict"].replace("_", " "),
        cause_id=g.get("cause") or g["verdict"], verdict=g["verdict"], culprit=culprit, op=op,
        module=module_label(g.get("module")) if g.get("op") else "", where=src.get("file") or "",
        code=str(src.get("code") or "").strip(), steps=_steps(g["first_step"], g["last_step"]),
        first_step=g["first_step"], ranks=", ".join(map(str, g["ranks"])) or "—",
        fix=fix_label(fix["kind"]) if show_fix else "", fix_code=fix["code"] if show_fix else "",
        verified=verified if show_fix else "", verified_tone=tone, reports=links[:MAX_LINKS],
        more_reports=links[MAX_LINKS:])


def summary_parts(doc: dict) -> list[Link]:
    """The one summary line in pieces; the failure counts link to the failure table."""
    from nanreplay.triage.rows import FAILURES

    counts = doc["counts"]
    groups = doc["groups"]
    causes = sum(g["verdict"] != "not_reproduced" for g in groups)
    parts = [Link(f"{counts['snapshots']} snapshot{'' if counts['snapshots'] == 1 else 's'}"),
             Link(f"{causes} root cause{'' if causes == 1 else 's'}", "#groups")]
    not_repro = sum(g["count"] for g in groups if g["verdict"] == "not_reproduced")
    if not_repro:
        parts.append(Link(f"{not_repro} not reproduced", "#groups"))
    parts += [Link(f"{n} {FAILURES.get(cat, cat)}", "#failures") for cat, n in sorted(counts["failures"].items())]
    return parts


def index_view(doc: dict) -> dict:
    """Everything index.html shows, as plain data; the template only lays it out."""
    groups = [_group_row(i, g) for i, g in enumerate(doc["groups"], 1)]
    titles = {g.id: g.cause for g in groups}
    numbers = {g.id: g.number for g in groups}
    return {"title": f"nanreplay triage: {doc['dir']}", "doc": doc, "groups": groups, "titles": titles,
            "numbers": numbers, "failures": doc["failures"], "ranks": doc["ranks"], "ignored": doc["ignored"],
            "machines": doc.get("machines"),
            "summary": summary_parts(doc), "failed": doc["counts"]["failed"], "any_ranks": any(g["ranks"] for g in doc["groups"]),
            "ignored_shown": doc["ignored"][:MAX_IGNORED], "ignored_more": max(0, len(doc["ignored"]) - MAX_IGNORED),
            "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def render_index(doc: dict) -> str:
    from markupsafe import Markup

    from nanreplay.report.html import asset, csp, jinja_env

    css, js = asset("triage.css"), asset("report.js")
    return jinja_env().get_template("triage.html.j2").render(**index_view(doc), css=Markup(css), js=Markup(js),
                                                             csp=csp(css, js))
