"""Grouping: what makes two snapshots the same bug, the groups largest first, and which rank failed first."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone


def signature(row: dict) -> tuple:
    """What makes two snapshots the same bug: the verdict, the cause, the op, and where it ran as what does not
    move when code is edited — the file's name, the function and the text of the code line (spaces aside). The
    line number only where no code text was recorded; the folder never (a checkout elsewhere, another machine, a
    native snapshot beside a plain state dict analyzed with --model: the same line). Without a source line, the
    module."""
    op = row.get("forward_op") or row.get("op")
    path = str(row.get("source_path") or row.get("source") or "")
    if not path:
        return (row.get("verdict"), row.get("cause"), op, row.get("module"))
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    if row.get("source") and not row.get("source_path"):
        name = name.rsplit(":", 1)[0]  # "file:line" as shown
    code = " ".join(str(row.get("code") or "").split())
    return (row.get("verdict"), row.get("cause"), op, name, row.get("function"), code or row.get("source_line"))


def group_id(sig: tuple) -> str:
    return "g" + hashlib.sha1(json.dumps(sig).encode()).hexdigest()[:10]


def build_groups(rows: list[dict]) -> list[dict]:
    """Analyzed rows grouped by signature, largest group first (then earliest step)."""
    by_id: dict[str, list[dict]] = {}
    for r in rows:
        if r["status"] == "analyzed":
            by_id.setdefault(r["group"], []).append(r)
    groups = []
    for gid, members in by_id.items():
        first = members[0]
        steps = [m["step"] for m in members if isinstance(m.get("step"), int)]
        verified = [m["fix_verified"] for m in members]
        groups.append({
            "id": gid, "count": len(members),
            "verdict": first["verdict"], "cause": first["cause"], "title": first["title"],
            "op": first["op"], "forward_op": first["forward_op"], "backward_node": first["backward_node"],
            "phase": first["phase"], "kind": first["kind"], "inf_sign": first.get("inf_sign"),
            "module": first["module"],
            "source": {"file": first["source"], "path": first["source_path"], "line": first["source_line"],
                       "code": first["code"]} if first["source"] else None,
            "first_step": min(steps) if steps else None, "last_step": max(steps) if steps else None,
            "ranks": sorted({m["rank"] for m in members if isinstance(m.get("rank"), int)}),
            "fix": {"kind": first["fix_kind"], "code": first["fix_code"],
                    "verified": sum(v is True for v in verified), "not_verified": sum(v is False for v in verified),
                    "of": len(members)},
            "snapshots": [{"file": m["file"], "report": m["report"], "json": m["json"], "step": m["step"],
                           "rank": m["rank"], "duplicate_of": m.get("duplicate_of") or None} for m in members],
        })
    inf = float("inf")
    groups.sort(key=lambda g: (-g["count"], g["first_step"] if g["first_step"] is not None else inf, g["id"]))
    return groups


def _when(created: str | None):
    if not created:
        return None
    try:
        t = datetime.fromisoformat(str(created).replace("Z", "+00:00"))
        return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def build_ranks(rows: list[dict]) -> dict | None:
    """Per step, which rank failed first and whether the ranks agree on the culprit.

    Only snapshots that carry both a step and a rank take part. Within a step, ranks are
    ordered by the time the snapshot was written, where every snapshot of that step has one.
    """
    ranked = [r for r in rows if isinstance(r.get("step"), int) and isinstance(r.get("rank"), int)]
    if not ranked:
        return None
    steps = []
    for step in sorted({r["step"] for r in ranked}):
        at = sorted((r for r in ranked if r["step"] == step), key=lambda r: r["rank"])
        times = [_when(r.get("created")) for r in at]
        first, by = None, None
        if len(at) == 1:
            first, by = at[0], "only rank"
        elif all(times):
            first, by = min(zip(times, at, strict=True), key=lambda x: x[0])[1], "written first"
        groups = {r["group"] for r in at if r["status"] == "analyzed"}
        failed = [r["rank"] for r in at if r["status"] != "analyzed"]
        agree = None if failed or len(at) < 2 else len(groups) == 1
        steps.append({"step": step, "ranks": [r["rank"] for r in at], "first_rank": first["rank"] if first else None,
                      "first_file": first["file"] if first else None, "ordered_by": by,
                      "agree": agree, "groups": sorted(g for g in groups if g), "failed_ranks": failed,
                      "entries": [{"rank": r["rank"], "file": r["file"], "group": r["group"], "report": r["report"],
                                   "created": r.get("created"), "status": r["status"]} for r in at]})
    earliest = steps[0]
    return {"steps": steps, "first": {"step": earliest["step"], "rank": earliest["first_rank"],
                                      "file": earliest["first_file"], "ranks": earliest["ranks"]},
            "world_size": max((r["world_size"] for r in ranked if isinstance(r.get("world_size"), int)), default=None)}
