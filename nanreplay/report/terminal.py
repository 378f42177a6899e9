"""The terminal summary: the report's banner in a few lines.

Built from the same `Banner` as the report's top block, so the two cannot disagree.
It quotes only what the analysis recorded and reads no file.
"""

from __future__ import annotations

from nanreplay.analysis.result import Analysis
from nanreplay.report.format import kind_text, module_label, where
from nanreplay.report.views.banner import anomaly_short, banner, failure_text, flow_row, loss_source_note
from nanreplay.report.views.compiler import compiler_line
from nanreplay.report.views.kernel import kernel_line
from nanreplay.report.views.machine import first_screen_line
from nanreplay.sanitize import one_line


def terminal_summary(a: Analysis | dict, report_path: str | None) -> str:
    """The banner in a few lines, for the terminal."""
    return "\n".join(terminal_lines(a, report_path))


def culprit_block(a: Analysis | dict) -> list[str]:
    """The summary's first lines — the verdict, the culprit and the failure — which the replay alone decides:
    printed as soon as it has them, before the diagnosis and the probe have run. Empty when the replay alone does
    not decide the verdict: a finite replay is what a spike, a dead-gradient or a transient snapshot's diagnosis
    reads, and it names the verdict itself (a block saying "not reproduced" first would be wrong)."""
    d = a.to_json() if isinstance(a, Analysis) else a
    if d.get("verdict") == "not_reproduced":
        return []
    return _lines(d, banner(d), None, block_only=True)


def terminal_lines(a: Analysis | dict, report_path: str | None) -> list[str]:
    """The summary's lines: `culprit_block`'s, then the cause, the fix, anomaly mode and where the report is."""
    d = a.to_json() if isinstance(a, Analysis) else a
    return _lines(d, banner(d), report_path)


_TONE_COLOUR = {"bad": "\033[1;31m", "warn": "\033[1;33m", "ok": "\033[1;32m"}  # bold red / yellow / green


def coloured(lines: list[str], a: Analysis | dict) -> list[str]:
    """The same lines with the verdict (the end of the first line) in its tone's colour: for a terminal only,
    the caller decides (a TTY, NO_COLOR unset). The verdict label is nanreplay's own text, never the snapshot's."""
    if not lines:
        return lines
    b = banner(a.to_json() if isinstance(a, Analysis) else a)
    head, sep, tail = lines[0].rpartition(": ")
    if not sep or tail != b.verdict_label:
        return lines
    return [f"{head}: {_TONE_COLOUR.get(b.tone, '')}{tail}\033[0m", *lines[1:]]


def _lines(d: dict, b, report_path: str | None, *, block_only: bool = False) -> list[str]:
    lines = [f"nanreplay: {d.get('snapshot')}: {b.verdict_label}"]
    c = d.get("culprit")
    if c:
        how = c["phase"]
        if c.get("backward_node"):
            how += f", {c['backward_node']} ← {c.get('forward_op')}"
        # NaN / +Inf / −Inf spelled as on the page (not upper-cased): one spelling everywhere
        lines.append(f"  culprit  {c['op']} ({how}) produced {kind_text(c.get('kind'), c.get('output'))}")
        src = c.get("source")
        loc = f"at {where(src)}" if src else \
            f"({loss_source_note(d)})" if c.get("module") == "<loss>" else "(no user source line)"
        lines.append(f"  module   {module_label(c.get('module'), (d.get('model') or {}).get('class'))}   {loc}")
        if src and src.get("code"):
            lines.append(f"           {src['code']}")
    else:
        lines.append(f"  {b.headline}")
        lines += _flow_lines(d, b)
        for r in (d.get("nonfinite_leaves") or [])[:5]:
            at = f"; bad samples (dim 0): {r['samples']}" if r.get("samples") else ""
            lines.append(f"  {r['role']:10} {r['name']}: {r['nan']} NaN, {r['inf']} Inf{at}")
    fail = failure_text(d)
    if fail:
        lines.append(f"  failure  {fail}")
    if block_only:
        return [one_line(ln) for ln in lines]
    if b.cause and b.cause.lower() != b.headline.lower():  # (a dead gradient's headline is its cause)
        lines.append(f"  cause    {b.cause}")
    lines += _broadcast_lines(d)
    machine = first_screen_line(d)
    if machine:
        lines.append(f"  {machine}")
    if b.fix:
        code = "\n".join(dl.text for dl in b.fix.diff if dl.sign == "+") if b.fix.diff else b.fix.code
        first, *rest = code.splitlines() or [""]
        lines.append(f"  fix      [{b.fix.badge.text.lstrip('✓✗ ')}] {first}")
        lines += [f"           {ln}" for ln in rest[:3]]
        if b.fix.badge.tone != "ok" and b.fix.verification:
            lines.append(f"           ({b.fix.verification})")
    compiled = compiler_line(d)
    if compiled:
        lines.append(f"  compiled {compiled}")
    kl = kernel_line(d)
    if kl:
        lines.append(f"  kernel   {kl}")
    am = anomaly_short(d)
    if am:
        lines.append(f"  anomaly  set_detect_anomaly {am}")
    if report_path:
        lines.append(f"  report   {report_path}")
    # Module names, paths, code and messages come from the snapshot: each line escaped and capped.
    return [one_line(ln) for ln in lines]


def _flow_lines(d: dict, b) -> list[str]:
    """A dead-gradient verdict: where the flow ends (op, module, line and its code) and which parameters stopped."""
    row = flow_row(d) if d.get("verdict") in ("gradient_cut", "gradient_zero") else None
    if row is None:
        return []
    mod = f" in module {row['module']!r}" if row.get("module") else ""
    loc = f" at {b.line.where}" if b.line else " (no source line recorded)"
    out = [f"  where    {row.get('op') or 'requires_grad=False'}{mod}{loc}"]
    if b.line and b.line.code:
        out.append(f"           {b.line.code}")
    names = list((d.get("gradient_flow") or {}).get("parameters") or [])
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    out.append(f"  params   {len(names)} stopped learning: {', '.join(map(str, names[:4]))}{more}")
    lz = row.get("local_zero") if isinstance(row.get("local_zero"), dict) else None
    if lz and lz.get("units") is not None:
        out.append(f"  zeroed   {100 * lz['units']:.0f}% of its units, {100 * lz.get('elements', 0):.0f}% of the elements "
                   "(a zero derivative for every sample)")
    jump = (d.get("gradient_flow") or {}).get("lr_jump")
    if isinstance(jump, dict) and all(isinstance(jump.get(k), (int, float)) for k in ("from", "to")):
        out.append(f"  history  the learning rate jumped from {jump.get('from'):.3g} to {jump.get('to'):.3g} at step "
                   f"{jump.get('step')}, before the units died")
    return out


def _broadcast_lines(d: dict) -> list[str]:
    """A loss whose inputs broadcast silently (diagnose/broadcast.py): said in every summary, healthy or not."""
    out = []
    for b in [b for b in d.get("broadcast") or [] if isinstance(b, dict)][:3]:
        src = b.get("source") if isinstance(b.get("source"), dict) else None
        at = f" at {where(src)}" if src else ""
        shapes = " with ".join(map(str, b.get("shapes") or []))
        out.append(f"  shape    {b.get('op')} broadcasts {shapes} to {b.get('broadcast_to')}{at}")
        if src and src.get("code"):
            out.append(f"           {str(src['code']).strip()}")
    return out
