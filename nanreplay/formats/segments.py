"""A step program cut into segments, one per module call: the nodes that ran inside that call (nested calls
nest). A segment's inputs are the tensors it reads that were made before it (parameters aside: they are
looked up when a node runs), its outputs those it makes that are read after it.

Two users: a sharded replay runs each FSDP unit's segment inside that unit's call (`shardedstep.py`), and
a replay that must hold less memory recomputes each segment's activations in backward (`StepModule.
checkpointed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanreplay.formats.program import Node, Program, Ref


@dataclass
class Segment:
    unit: str | None  # None: ops outside any (non-root) unit
    start: int
    stop: int
    children: list[Segment] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)


def _refs(v: Any) -> list[int]:
    if isinstance(v, Ref):
        return [int(v)]
    if isinstance(v, list):
        return [x for e in v for x in _refs(e)]
    return []


def node_inputs(node: Node) -> list[int]:
    return _refs(node.args) + _refs(list(node.kwargs.values()))


def node_outputs(node: Node) -> list[int]:
    return [r for r in (node.out if isinstance(node.out, list) else [node.out]) if r is not None]


def unit_chains(program: Program, units: set[str]) -> list[tuple[tuple[int, str], ...]]:
    """Per node: the (non-root) unit calls it ran inside, outermost first, as (scope id, unit name)."""
    out = []
    for node in program.nodes:
        chain = []
        s = node.scope
        while s is not None and s >= 0:
            m, parent = program.scopes[s]
            if program.modules[m] in units:
                chain.append((s, program.modules[m]))
            s = parent
        out.append(tuple(reversed(chain)))
    return out


def plan(program: Program, units: set[str]) -> list[Segment]:
    """The program as nested unit segments."""
    chains = unit_chains(program, units)
    params = {lf.ref for lf in program.leaves if lf.kind == "param"}
    last_use: dict[int, int] = {}
    for i, node in enumerate(program.nodes):
        for r in node_inputs(node):
            last_use[r] = i
    last_use[program.loss] = len(program.nodes)

    def split(a: int, b: int, depth: int) -> list[Segment]:
        segs: list[Segment] = []
        i = a
        while i < b:
            key = chains[i][depth] if len(chains[i]) > depth else None
            j = i + 1
            while j < b and (chains[j][depth] if len(chains[j]) > depth else None) == key and key is not None:
                j += 1
            if key is None:
                if segs and segs[-1].unit is None:
                    segs[-1].stop = j
                else:
                    segs.append(Segment(None, i, j))
            else:
                seg = Segment(key[1], i, j, split(i, j, depth + 1))
                made: set[int] = set()
                for node in program.nodes[i:j]:
                    for r in node_inputs(node):
                        if r not in made and r not in params and r not in seg.inputs:
                            seg.inputs.append(r)
                    made.update(node_outputs(node))
                seg.outputs = sorted(r for r in made if last_use.get(r, -1) >= j)
                segs.append(seg)
            i = j
        return segs

    return split(0, len(program.nodes), 0)
