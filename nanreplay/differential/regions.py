"""A step program's nodes as FX graphs that `torch.compile` can compile, and a replay with some regions compiled.

    g = region_graph(model, a, b)         # nodes a..b of the program as a GraphModule: inputs -> outputs
    out = replay(subject, {(a, b): fn})   # the step, eager except those regions (each run by its callable)

A region's inputs are every ref it reads that was made before it (the parameters included: autograd sees them
as graph inputs); its outputs the refs it makes that are read after it (or the loss). The graph calls the same
aten ops the eager replay calls, with the same literal arguments: the program's recorded random values and
dropout masks are constants of the graph, uninitialised memory is zeros, as in `StepModule`. `wide` (a dtype)
computes the region in that dtype: its floating inputs are cast up, every narrower floating dtype the nodes
name becomes `wide`, and its outputs are cast back to the dtypes the program recorded.

Nothing here checks argument values: the regions are the nodes of a program that the analysis already
validated and replayed eagerly, value checks included (formats/opchecks.py), on the same batch and weights.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from nanreplay import stats
from nanreplay import torch_internals as ti
from nanreplay.confine import progress
from nanreplay.formats.dryrun import with_output_size
from nanreplay.formats.program import DeviceLiteral, Program, Ref, node_inputs, node_outputs
from nanreplay.formats.stepmodel import _FILL_ZERO, _HALF_TO_FLOAT

Region = tuple[int, int]


def region_io(program: Program, a: int, b: int) -> tuple[list[int], list[int]]:
    """(inputs, outputs) of nodes a..b: refs read there and made before, refs made there and read after."""
    made: set[int] = set()
    ins: list[int] = []
    for node in program.nodes[a:b]:
        for r in node_inputs(node):
            if r not in made and r not in ins:
                ins.append(r)
        made.update(node_outputs(node))
    later = {program.loss} | {r for node in program.nodes[b:] for r in node_inputs(node)}
    return ins, sorted(r for r in made if r in later)


def ref_dtypes(program: Program) -> dict[int, torch.dtype]:
    """Every ref's recorded dtype (leaves and node outputs)."""
    out: dict[int, torch.dtype] = {}
    for lf in program.leaves:
        d = getattr(torch, lf.dtype, None)
        if isinstance(d, torch.dtype):
            out[lf.ref] = d
    for node in program.nodes:
        for r, (_shape, name) in zip(node_outputs(node), node.meta, strict=False):
            d = getattr(torch, str(name), None)
            if isinstance(d, torch.dtype):
                out[r] = d
    return out


def wider(d: torch.dtype) -> torch.dtype:
    """The dtype a region is recomputed in to test range/precision: float64 for float32, float32 below it."""
    return torch.float64 if d in (torch.float32, torch.float64) else torch.float32


def compilable(program: Program, a: int, b: int) -> str | None:
    """Why nodes a..b cannot be one graph here, or None: grad mode must be one throughout (a graph has one)."""
    if len({node.grad for node in program.nodes[a:b]}) > 1:
        return "its nodes run partly under no_grad"
    return None


def region_graph(model, a: int, b: int, wide: torch.dtype | None = None,
                 wide_range: Region | None = None) -> fx.GraphModule:
    """Nodes a..b of `model`'s program (a StepModule) as a GraphModule over (inputs...) -> (outputs...); with
    `wide`, the nodes in `wide_range` (default: all of them) compute in that dtype, cast up where they read a
    narrower value and back to the recorded dtype where a node outside them, or the graph's output, reads one."""
    prog: Program = model.program
    ins, outs = region_io(prog, a, b)
    lo, hi = wide_range or (a, b)
    dtypes = ref_dtypes(prog)
    root = torch.nn.Module()
    g = fx.Graph()
    env: dict[int, Any] = {}  # refs in their recorded dtypes
    wenv: dict[int, Any] = {}  # refs in `wide` (made or cast up there)
    narrow = {d for d in (torch.float16, torch.bfloat16, torch.float32) if wide is not None
              and torch.finfo(d).bits < torch.finfo(wide).bits}

    def cast(v, d):
        return g.call_function(torch.ops.aten._to_copy.default, (v,), {"dtype": d})

    def read(r: int, in_wide: bool):
        if in_wide:
            if r not in wenv:
                wenv[r] = cast(env[r], wide) if dtypes.get(r) in narrow else env[r]
            return wenv[r]
        if r not in env:
            env[r] = cast(wenv[r], dtypes[r]) if dtypes.get(r) in narrow else wenv[r]
        return env[r]

    for k, r in enumerate(ins):
        env[r] = g.placeholder(f"in{k}")
    n_const = [0]

    def const(t: torch.Tensor, in_wide: bool) -> Any:
        name = f"c{n_const[0]}"
        n_const[0] += 1
        root.register_buffer(name, t.detach().clone())
        c = g.get_attr(name)
        return cast(c, wide) if in_wide and t.dtype in narrow else c

    def arg(v, in_wide: bool):
        if isinstance(v, Ref):
            return read(int(v), in_wide)
        if isinstance(v, DeviceLiteral):
            return model.device
        if isinstance(v, torch.dtype):
            return wide if in_wide and v in narrow else v
        if isinstance(v, list):
            return [arg(x, in_wide) for x in v]
        return v

    for i in range(a, b):
        node = prog.nodes[i]
        w = wide is not None and lo <= i < hi
        args = [arg(x, w) for x in node.args]
        kwargs = with_output_size(node, {k: arg(v, w) for k, v in node.kwargs.items()})
        if node.random is not None:
            value = const(model.constants[node.random], w)
            out = g.call_function(torch.ops.aten.copy_.default, (args[0], value)) \
                if ti.op_mutated_args(node.op)[0] else value
        elif node.mask is not None:
            p = float(args[1] if len(args) > 1 else kwargs["p"])  # (a program may name p)
            mask = const(model.constants[node.mask], False)
            kept = g.call_function(torch.ops.aten.mul.Tensor, (args[0], g.call_method("type_as", (mask, args[0]))))
            out = (g.call_function(torch.ops.aten.mul.Tensor, (kept, 0.0 if p >= 1 else 1.0 / (1.0 - p))), mask)
        else:
            if w and node.name in _HALF_TO_FLOAT and len(args) > 2 and args[2]:
                args[2] = False  # half_to_float: the input is no longer half
            out = g.call_function(node.op, tuple(args), kwargs)
            if node.name in _FILL_ZERO:
                out = g.call_function(torch.ops.aten.zeros_like.default, (out,))
        _bind(g, node, out, wenv if w else env)
        if w:
            for r in node_outputs(node):
                env.pop(r, None)
    g.output(tuple(read(r, False) for r in outs))
    return fx.GraphModule(root, g)


def _bind(g: fx.Graph, node, out: Any, env: dict) -> None:
    if not isinstance(node.out, list):
        if node.out is not None:
            env[int(node.out)] = out
        return
    for k, r in enumerate(node.out):
        if r is not None:
            env[int(r)] = out[k] if isinstance(out, tuple) else g.call_function(operator.getitem, (out, k))


def forward(model, inputs: Any, target: Any, regions: dict[Region, Any]) -> torch.Tensor:
    """The program's forward with each region run by its callable (inputs -> outputs), the rest node by node."""
    prog: Program = model.program
    env = model._leaves(inputs, target)
    grad_on = torch.is_grad_enabled()
    dead = prog.dead_after()
    at = 0
    try:
        for (a, b), fn in sorted(regions.items()):
            model._run_nodes(at, a, env, grad_on)
            ins, outs = region_io(prog, a, b)
            progress.at(progress.REPLAY, a, f"compiled region at nodes {a}-{b - 1}")
            with torch.set_grad_enabled(prog.nodes[a].grad and grad_on):
                vals = fn(*[env[r] for r in ins])
            env.update(zip(outs, vals, strict=True))
            for i in range(a, b):
                for r in dead[i]:
                    if r not in outs:
                        env.pop(r, None)
            at = b
        model._run_nodes(at, len(prog.nodes), env, grad_on)
    finally:
        torch.set_grad_enabled(grad_on)
        model._node = None
        progress.at(progress.AFTER, -1)
    return env[prog.loss]


def replay(subject, regions: dict[Region, Any]) -> dict:
    """One uninstrumented step on an independent copy, the `regions` run by their callables: the loss and
    the gradients, as the differential's `ran` rows hold them."""
    copy = subject.converted()
    if copy.prepare is not None:
        copy.prepare()
    model = copy.model
    model.zero_grad(set_to_none=True)
    loss = copy.loss(forward(model, copy.inputs, copy.target, regions))
    k = subject.loss_scale or 1.0
    value = float(loss.detach().double()) / k
    if loss.requires_grad:
        loss.backward()
    bad, sq = [], 0.0
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        if not stats.finite_fast(p.grad):
            bad.append(n)
        else:
            sq += float(p.grad.detach().double().pow(2).sum())
    model.zero_grad(set_to_none=True)
    return {"loss": stats._num(value), "loss_finite": math.isfinite(value), "grads_finite": not bad,
            "nonfinite_grads": len(bad), "first_nonfinite_grad": bad[0] if bad else None,
            "grad_norm": math.sqrt(sq) / k if not bad else None}
