"""The compiler's differential replay (`differential.compiler`): its verdict, the region, every replay it made.

`compiler_view` is the report's section (and, where the verdict decides the diagnosis, the verdict area's
summary of it); `compiler_line` is the one line the terminal and the Markdown summary print.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanreplay.report.format import num

_LABEL = {"compiled_numerics_confirmed": "compiled numerics confirmed",
          "not_reproduced_compiled": "not reproduced compiled either",
          "control_nonfinite": "non-finite under aot_eager too",
          "eager_nonfinite": "eager replay not finite here", "skipped": "not replayed compiled"}
_TONE = {"compiled_numerics_confirmed": "bad", "control_nonfinite": "bad", "not_reproduced_compiled": "ok"}
DECIDES = ("compiled_numerics_confirmed", "control_nonfinite")


@dataclass
class CompiledRun:
    what: str
    where: str
    loss: str
    gradients: str
    finite: bool
    seconds: str


@dataclass
class CompiledFix:
    label: str
    code: str
    verified: bool
    verification: str


@dataclass
class CompilerView:
    verdict: str
    label: str
    tone: str  # bad | ok | warn
    sentence: str
    decides: bool  # the verdict is the diagnosis: the verdict area shows it
    region: str = ""
    ops: list[str] = field(default_factory=list)
    source: str = ""
    runs: list[CompiledRun] = field(default_factory=list)
    fixes: list[CompiledFix] = field(default_factory=list)
    skipped: str = ""
    cost: str = ""


def _compiler(d: dict) -> dict | None:
    c = (d.get("differential") or {}).get("compiler")
    return c if isinstance(c, dict) else None


def compiler_view(d: dict) -> CompilerView | None:
    c = _compiler(d)
    if c is None:
        return None
    verdict = str(c.get("verdict") or "skipped")
    r = c.get("region") if isinstance(c.get("region"), dict) else {}
    src = r.get("source") if isinstance(r.get("source"), dict) else None
    runs = []
    for row in c.get("ran") or []:
        if not isinstance(row, dict):
            continue
        grads = (f"could not compile: {row['error']}" if row.get("error") else "finite" if row.get("grads_finite") else
                 f"{row.get('nonfinite_grads')} non-finite" if row.get("grads_finite") is False else "—")
        runs.append(CompiledRun(str(row.get("what") or ""), str(row.get("where") or ""), num(row.get("loss")), grads,
                                bool(row.get("finite")), f"{float(row.get('seconds') or 0):.2f} s"))
    fixes = [CompiledFix(str(f.get("label") or ""), str(f.get("code") or ""), bool(f.get("verified")),
                         str(f.get("verification") or "")) for f in c.get("fixes") or [] if isinstance(f, dict)]
    n = int(c.get("compiled_replays") or 0)
    return CompilerView(
        verdict=verdict, label=_LABEL.get(verdict, verdict.replace("_", " ")), tone=_TONE.get(verdict, "warn"),
        sentence=str(c.get("sentence") or ""), decides=verdict in DECIDES, region=str(r.get("where") or ""),
        ops=[str(o) for o in r.get("ops") or []], source=f"{src.get('file')}:{src.get('line')}" if src else "",
        runs=runs, fixes=fixes, skipped=str(c.get("skipped") or ""),
        cost=f"{n} compiled replay{'s' if n != 1 else ''}, {float(c.get('seconds') or 0):.1f} s")


def compiled_verdict(d: dict) -> str | None:
    """The verdict area's headline where the compiled replay decides the diagnosis (None elsewhere)."""
    c = _compiler(d)
    if c is None or c.get("verdict") not in DECIDES or not isinstance(c.get("region"), dict):
        return None
    return (f"The step is non-finite compiled with {c.get('backend')} and finite in eager; the smallest compiled "
            f"region that fails alone: {c['region'].get('where')}")


def compiler_line(d: dict) -> str | None:
    """One line: the verdict, the region and its ops, the verified fix — or why it was not replayed."""
    c = _compiler(d)
    if c is None:
        return None
    verdict = str(c.get("verdict") or "skipped")
    if verdict == "skipped":
        return f"not replayed compiled: {c.get('skipped') or 'no reason given'}"
    r = c.get("region") if isinstance(c.get("region"), dict) else None
    head = _LABEL.get(verdict, verdict)
    if r:
        head += f" in {r.get('where')} ({', '.join((r.get('ops') or [])[:3]) or 'no compute op'})"
    good = next((f for f in c.get("fixes") or [] if isinstance(f, dict) and f.get("verified")), None)
    if good:
        head += f"; verified fix: {good.get('label')}"
    return f"{head} [{c.get('backend')} vs eager, {c.get('compiled_replays', 0)} compiled replays]"
