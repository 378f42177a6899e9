"""A step program cut into segments, one per module call: the nodes that ran inside that call (nested calls
nest). A segment's inputs are the tensors it reads that were made before it (parameters aside: they are
looked up when a node runs), its outputs those it makes that are read after it.

Two users: a sharded replay runs each FSDP unit's segment inside that unit's call (`shardedstep.py`), and
a replay that must hold less memory recomputes each segment's activations in backward (`StepModule.
checkpointed`; `checkpoint_plan` says which segments may be recomputed and at which depth).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanreplay import torch_internals as ti
from nanreplay.formats.program import Node, Program, node_inputs, node_outputs, refs_in


@dataclass
class Segment:
    unit: str | None  # None: ops outside any (non-root) unit
    start: int
    stop: int
    children: list[Segment] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    params: list[int] = field(default_factory=list)  # the parameter leaves it reads (looked up, not passed in)


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
                        if r in params:
                            if r not in seg.params:
                                seg.params.append(r)
                        elif r not in made and r not in seg.inputs:
                            seg.inputs.append(r)
                    made.update(node_outputs(node))
                seg.outputs = sorted(r for r in made if last_use.get(r, -1) >= j)
                segs.append(seg)
            i = j
        return segs

    return split(0, len(program.nodes), 0)


def checkpoint_plan(program: Program, min_segments: int = 3) -> list[Segment] | None:
    """Segments for a checkpointed replay (computed once per program): module calls at one depth below the model, those whose
    recomputation gives what their first run gave marked for it (unit set), the rest run plainly (unit
    None). None when no depth has `min_segments` such calls.

    The depth is the one that should hold least, counting a node's output as one unit: a checkpointed
    replay keeps each segment's input, one segment's graph at a time in backward, and every plain node's
    (so a transformer splits into its blocks, a ResNet into its residual blocks, not into `layers`).
    A recomputed BatchNorm updates its running statistics twice: a checkpointed replay's buffers are not
    the step's (the precision probe never reads them)."""
    if "_checkpoint_plan" in program.__dict__:
        return program.__dict__["_checkpoint_plan"]
    depth_of: dict[int, int] = {}
    for s, (_m, parent) in enumerate(program.scopes):
        depth_of[s] = 0 if parent < 0 else depth_of.get(parent, 0) + 1
    write_only = _write_only_buffers(program)
    best: tuple[int, list[Segment]] | None = None
    for depth in range(1, 7):
        units = {program.modules[program.scopes[s][0]] for s, d in depth_of.items() if d == depth}
        if not units:
            break
        out: list[Segment] = []
        for seg in plan(program, units):
            if seg.unit is None or not _recomputable(program, seg, write_only):
                seg = Segment(None, seg.start, seg.stop)
            if out and out[-1].unit is None and seg.unit is None:
                out[-1].stop = seg.stop
            else:
                out.append(seg)
        marked = [seg.stop - seg.start for seg in out if seg.unit]
        if len(marked) < min_segments:
            continue
        held = len(marked) + max(marked) + sum(seg.stop - seg.start for seg in out if not seg.unit)
        if best is None or held < best[0]:
            best = (held, out)
    program.__dict__["_checkpoint_plan"] = best[1] if best else None
    return program.__dict__["_checkpoint_plan"]


def live_at(program: Program, starts: set[int]) -> dict[int, list[int]]:
    """Per node index in `starts`: the refs live there, made by an earlier node and read by it or a later one
    (leaves aside: parameters, buffers, the batch and constants are a replay's own)."""
    made: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, node in enumerate(program.nodes):
        for r in node_inputs(node):
            last[r] = i
        for r in node_outputs(node):
            made.setdefault(r, i)
    last[program.loss] = len(program.nodes)
    return {s: sorted(r for r, i in made.items() if i < s <= last.get(r, -1)) for s in sorted(starts)}


def writes_outside(program: Program, start: int) -> bool:
    """Whether some node from `start` on may write into a tensor made before it, a leaf, or a view of one (a
    replay of those nodes would then change what another replay of them starts from)."""
    return not _recomputable(program, Segment("rest", start, len(program.nodes)), set())


def first_leaf_write(program: Program) -> int:
    """The first node that may write into a leaf (a weight, a buffer, the batch, a constant) or a view of one:
    a replay that starts after it would read the leaf as captured, not as that node left it. Fail closed: an op
    whose schema cannot be read writes everything it is given. len(nodes) where none does."""
    leafy = {lf.ref for lf in program.leaves}  # refs that are, or may alias, a leaf
    for i, node in enumerate(program.nodes):
        schema = ti.op_schema(node.op)
        if schema is None:
            return i
        aliased = False
        for a, v in _schema_args(schema, node):
            refs = refs_in(v)
            if a.alias_info is not None and any(r in leafy for r in refs):
                if _writes(a):
                    return i
                aliased = True
        if aliased and any(r.alias_info is not None for r in schema.returns):
            leafy.update(node_outputs(node))
    return len(program.nodes)


def _recomputable(program: Program, seg: Segment, write_only: set[int]) -> bool:
    """Whether running the segment again gives what its first run gave: no node writes into a tensor the
    segment did not make itself (an input, a weight, or a view of one) — dropout's fresh mask filled in
    place is fine, ReLU(inplace=True) on the segment's input is not. A buffer that no node reads (only
    writes: BatchNorm's batch counter) may be written: it is then updated twice, and nothing reads it.
    No wherever an op's schema cannot be read (fail closed)."""
    fresh: set[int] = set()  # refs the segment made that alias nothing from outside it
    for node in program.nodes[seg.start:seg.stop]:
        schema = ti.op_schema(node.op)
        if schema is None:
            return False
        aliased = []  # what the result may alias: the arguments with an alias annotation (self of add_, a view's base)
        for a, v in _schema_args(schema, node):
            refs = refs_in(v)
            if a.alias_info is not None:
                aliased += refs
            if _writes(a) and any(r not in fresh and r not in write_only for r in refs):
                return False
        if not any(r.alias_info is not None for r in schema.returns) or all(r in fresh for r in aliased):
            fresh.update(node_outputs(node))
    return True


def _write_only_buffers(program: Program) -> set[int]:
    """Buffer leaves that nodes only write into, never read as a value — through any alias either (an in-place
    op's result, a view). Fail closed: an op whose schema cannot be read reads everything it is given."""
    buffers = {lf.ref for lf in program.leaves if lf.kind == "buffer"}
    owner = {r: r for r in buffers}  # ref -> the buffer it aliases
    read: set[int] = set()
    for node in program.nodes:
        schema = ti.op_schema(node.op)
        pairs = _schema_args(schema, node) if schema is not None else [(None, v) for v in node.args]
        touched = set()  # buffers the result may alias
        for a, v in pairs:
            for r in refs_in(v):
                if r in owner:
                    if a is None or a.alias_info is not None:
                        touched.add(owner[r])
                    if a is None or not _writes(a):
                        read.add(owner[r])
        if touched and (schema is None or any(r.alias_info is not None for r in schema.returns)):
            for r in node_outputs(node):  # the result may alias what it was given
                owner[r] = min(touched)
                if len(touched) > 1:
                    read.update(touched)
    return buffers - read


def _schema_args(schema: Any, node: Node) -> list[tuple[Any, Any]]:
    args = list(node.args) + [node.kwargs.get(a.name) for a in schema.arguments[len(node.args):]]
    return list(zip(schema.arguments, args, strict=False))


def _writes(a: Any) -> bool:
    return a.alias_info is not None and a.alias_info.is_write
