"""The kernel differential (differential/kernel.py) as the report shows it: the node alone, kernel vs reference.

`kernel_view` is the section; `kernel_line` the one line the terminal and Markdown summaries give it. Both read
`differential["kernel"]` of the analysis JSON only (no torch: the confined analysis's parent renders them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanreplay.numbers import num
from nanreplay.report.views.elements import Badge, Cell

_BADGES = {"kernel_differs": Badge("the kernel, not your math", "bad"),
           "reference_agrees": Badge("your math, not the kernel", "warn"),
           "not_reproduced": Badge("not reproduced alone", "muted"),
           "skipped": Badge("skipped", "muted")}


@dataclass
class KernelView:
    question: str
    badge: Badge
    sentence: str
    rows: list[list[Cell]] = field(default_factory=list)  # what ran: [what, op, dtype, result]
    fix_code: str | None = None
    fix_verification: str | None = None
    fix_verified: bool | None = None
    decides: bool = False  # it made the diagnosis: shown in the first screen, right under the verdict
    seconds: str = ""


def kernel_view(d: dict) -> KernelView | None:
    k = (d.get("differential") or {}).get("kernel")
    if not k:
        return None
    rows = []
    for r in k.get("ran") or []:
        bad = not r.get("finite")
        result = "finite" if not bad else " and ".join(
            p for p in (f"{num(r.get('nan'))} NaN" if r.get("nan") else "",
                        f"{num(r.get('inf'))} Inf" if r.get("inf") else "") if p) or "non-finite"
        rows.append([Cell(str(r.get("what"))), Cell(str(r.get("op"))), Cell(str(r.get("dtype"))),
                     Cell(f"{result} ({r.get('outputs', 'outputs')})", bad=bad)])
    fix = k.get("fix") or {}
    cause = (d.get("diagnosis") or {}).get("cause")
    return KernelView(question=str(k.get("question") or ""), badge=_BADGES.get(k.get("verdict"), _BADGES["skipped"]),
                      sentence=str(k.get("sentence") or ""), rows=rows, fix_code=fix.get("code"),
                      fix_verification=fix.get("verification"), fix_verified=fix.get("verified"),
                      decides=cause == "kernel_differs", seconds=num(k.get("seconds")))


def kernel_line(d: dict) -> str | None:
    """One line for the terminal / Markdown summary (None: the replay did not run)."""
    k = (d.get("differential") or {}).get("kernel")
    if not k:
        return None
    op = str(k.get("op") or "").removeprefix("aten.").removesuffix(".default")
    if k.get("verdict") == "skipped":
        return f"kernel replay of {op} skipped: {k.get('skipped')}"
    fix = k.get("fix") or {}
    tail = "; forcing the reference made the step finite (verified)" if fix.get("verified") else ""
    return f"{op} alone vs {k.get('reference')}: {_BADGES.get(k.get('verdict'), _BADGES['skipped']).text}{tail}"
