"""The causal chain: every non-finite event from where the value was made to the failure, long runs folded."""

from __future__ import annotations

from dataclasses import dataclass

from nanreplay.report.format import kind_text, module_label, op_base, short_where, where

COLLAPSE_RUN = 3  # runs of more propagation events than this are collapsed
MAX_CHAIN_ROWS = 400  # chain events rendered in all (the JSON keeps every one)


@dataclass
class ChainEvent:
    index: int
    phase: str
    op: str
    node: str
    forward_op: str
    module: str
    role: str
    kind: str
    nan: int
    posinf: int
    neginf: int
    numel: int
    where: str
    code: str
    culprit: bool
    failure: bool


@dataclass
class ChainGroup:
    events: list[ChainEvent]
    collapsed: bool
    summary: str


@dataclass
class FlowStep:
    title: str
    detail: str
    role: str  # origin | conversion | literal | propagation | failure | more
    kind: str


# What each role means, said on the page (the legend) and on hover (the role labels).
ROLES = {
    "origin": "made here: every input was finite",
    "conversion": "Inf in, NaN out (0 × ∞, ∞ − ∞, ∞ / ∞)",
    "literal": "an intentional constant (a -inf mask): not a bug by itself",
    "propagation": "a NaN/Inf that came in and went on",
    "failure": "what broke the step: the loss, or the first non-finite parameter gradient",
}


@dataclass
class ChainView:
    flow: list[FlowStep]
    groups: list[ChainGroup]
    total: int
    shown: int
    legend: list[tuple[str, str]]  # (role, what it means) for the roles on this chain


def _event(e: dict, culprit_index: int | None, failure_index: int | None) -> ChainEvent:
    src = e.get("source")
    return ChainEvent(index=e.get("index", -1), phase=e.get("phase", ""), op=e.get("op", ""),
                      node=e.get("backward_node") or "", forward_op=e.get("forward_op") or "",
                      module=module_label(e.get("module")), role=e.get("role", ""),
                      kind=kind_text(e.get("kind"), e), nan=e.get("nan", 0), posinf=e.get("posinf", 0),
                      neginf=e.get("neginf", 0), numel=e.get("numel", 0), where=short_where(src),
                      code=f"{where(src)}: {(src or {}).get('code') or ''}" if src else "",
                      culprit=e.get("index") == culprit_index, failure=e.get("index") == failure_index)


def _run_summary(run: list[ChainEvent]) -> str:
    ops: dict[str, int] = {}
    for e in run:
        ops[op_base(e.op)] = ops.get(op_base(e.op), 0) + 1
    top = ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:6])
    mods = sorted({e.module for e in run})
    where_ = f" in {', '.join(mods[:3])}" + (f" and {len(mods) - 3} more modules" if len(mods) > 3 else "")
    return f"{len(run)} propagation steps{where_} ({top}{', …' if len(ops) > 6 else ''})"


def chain_view(d: dict) -> ChainView | None:
    chain = d.get("chain") or []
    if not chain:
        return None
    c = d.get("culprit")
    culprit_index = c.get("event") if c else None
    failure_index = (d.get("failure") or {}).get("event")
    events = [_event(e, culprit_index, failure_index) for e in chain]

    def keep(i: int, e: ChainEvent) -> bool:  # always visible: the story's turning points and its ends
        return e.role != "propagation" or e.culprit or e.failure or i == 0 or i == len(events) - 1

    groups: list[ChainGroup] = []
    run: list[ChainEvent] = []

    def flush() -> None:
        if not run:
            return
        if len(run) > COLLAPSE_RUN:
            groups.append(ChainGroup(list(run), True, _run_summary(run)))
        else:
            groups.extend(ChainGroup([e], False, "") for e in run)
        run.clear()

    for i, e in enumerate(events):
        if keep(i, e):
            flush()
            groups.append(ChainGroup([e], False, ""))
        else:
            run.append(e)
    flush()

    # Cap what is rendered: a huge run keeps its first and last events (the JSON keeps all).
    shown = 0
    budget = MAX_CHAIN_ROWS
    for g in groups:
        if g.collapsed and len(g.events) > budget // 2 > 0:
            half = max(1, budget // 4)
            dropped = len(g.events) - 2 * half
            g.summary += f"; {dropped} in the middle not shown (see --json)"
            g.events = g.events[:half] + g.events[-half:]
        shown += len(g.events)
        budget = max(0, budget - len(g.events))

    flow: list[FlowStep] = []
    skipped = 0

    def more() -> None:
        nonlocal skipped
        if skipped:  # the same count the table shows between these two steps
            flow.append(FlowStep(f"{skipped} propagation step{'s' if skipped > 1 else ''}", "", "more", ""))
        skipped = 0

    for e in events:
        if e.failure:
            continue  # the failure step below stands for it
        if e.role == "propagation" and not e.culprit:
            skipped += 1
            continue
        more()
        flow.append(FlowStep(op_base(e.op), f"{e.node or e.phase} · {e.module}", e.role, e.kind))
    more()
    f = d.get("failure")
    if f:
        what = {"loss": "the loss", "parameter": f"weight {f.get('name')}"}.get(f.get("what"), f"grad of {f.get('name')}")
        fev = next((e for e in chain if e.get("index") == failure_index), None)
        flow.append(FlowStep(what, "the failure", "failure", kind_text(f.get("kind"), fev)))
    if len(flow) > 12:
        flow = flow[:5] + [FlowStep(f"{len(flow) - 10} more steps", "", "more", "")] + flow[-5:]
    roles = {e.role for e in events} | ({"failure"} if f else set())
    legend = [(r, ROLES[r]) for r in ROLES if r in roles]
    return ChainView(flow=flow, groups=groups, total=len(events), shown=shown, legend=legend)
