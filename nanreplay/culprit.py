"""The culprit, exactly as DESIGN.md defines it.

The chain is every event linked by provenance from the failure back to its
sources, in causal (execution) order. The culprit is the earliest non-literal
`origin` on the chain; where every source is literal, the earliest
`conversion`. Where the chain holds neither (only literals and propagation),
the earliest literal is the only thing left to blame.
"""

from __future__ import annotations

from nanreplay.enums import Role
from nanreplay.replay import Event


def chain(events: list[Event], failure_event: int | None) -> list[int]:
    """Indices of the failure's event and all its ancestors, in causal order."""
    if failure_event is None:
        return []
    seen = {failure_event}
    todo = [failure_event]
    while todo:
        for p in events[todo.pop()].parents:
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return sorted(seen)


def culprit(events: list[Event], chain_: list[int]) -> int | None:
    for role in (Role.ORIGIN, Role.CONVERSION, Role.LITERAL):
        for i in chain_:
            if events[i].role == role:
                return i
    return chain_[0] if chain_ else None
