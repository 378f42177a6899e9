"""A rank's step program run under FSDP2 on N ranks: the weights sharded at rest, as in training.

`ShardedStepModule` is a `StepModule` whose containers for the snapshot's FSDP units are real FSDP2
units (`fully_shard`): each unit's ops run inside a call of its container, so FSDP2 itself gathers the
unit's parameters before them, frees them after, gathers them again for backward and reduce-scatters
the gradients — the collectives the training run made, in the same order on every rank (FSDP2 training
relied on that order too). A rank holds 1/N of the weights plus one unit gathered at a time, its batch and
its activations: what its training step held, less the optimizer state.

Each unit call is one "segment" of the program: the nodes that ran inside that unit's module call (nested
units nest). A segment's inputs are the tensors it reads that were made before it; its outputs those it
makes that are read after it (FSDP2 hooks both, as for any module). Parameters are looked up when a node
runs: during a unit's call they are the gathered tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from nanreplay.errors import SnapshotError
from nanreplay.formats.dryrun import dry_run
from nanreplay.formats.program import DTYPES, Program, node_inputs
from nanreplay.formats.segments import Segment, plan
from nanreplay.formats.stepmodel import StepModule, _container


class _Unit(nn.Module):
    """A container that FSDP2 shards; its forward runs one segment of the program."""

    def forward(self, run, *tensors):
        return run(tensors)


class ShardedStepModule(StepModule):
    """A step program whose FSDP units are FSDP2 units (see the module docstring)."""

    def __init__(self, program: Program, state: dict[str, torch.Tensor], parameters: list[str], aliases: dict[str, str],
                 constants: dict[str, torch.Tensor], units: list[str], *, step_fn: bool = False):
        super().__init__(program, state, parameters, aliases, constants, step_fn=step_fn)
        inner = sorted((u for u in units if u), key=lambda u: -u.count("."))  # deepest first, as fully_shard wants
        for u in inner:
            _container(self, f"{u}._")[0].__class__ = _Unit
        self.__dict__["units"] = inner
        self.__dict__["segments"] = plan(program, set(inner))
        self.__dict__["param_refs"] = {lf.ref: aliases.get(lf.name, lf.name) for lf in program.leaves if lf.kind == "param"}

    def shard(self, mesh: Any = None) -> None:
        """fully_shard every unit, deepest first, then the root (collective: every rank calls it)."""
        from torch.distributed.fsdp import fully_shard

        for u in self.units:
            fully_shard(self.get_submodule(u), mesh=mesh)
        fully_shard(self, mesh=mesh)

    def adopt(self, buffers: dict[str, torch.Tensor], constants: dict[str, torch.Tensor], device: torch.device) -> None:
        """After `to_empty`: the real buffers and constants, and where the replay runs."""
        with torch.no_grad():
            for name, b in self.named_buffers():
                b.copy_(buffers[name])
        self.__dict__["constants"] = {k: v.to(device) for k, v in constants.items()}
        self.__dict__["_by_name"] = dict(self.named_buffers())
        self.__dict__["_pristine"] = {n: b.detach().clone() for n, b in self.named_buffers()}
        self.__dict__["_versions"] = {}
        self.__dict__["device"] = device

    def _apply(self, fn, recurse=True):  # to_empty / to(device): the caller adopts constants and buffers after
        return nn.Module._apply(self, fn, recurse)

    def leaf_tensor(self, lf, batch: dict) -> torch.Tensor:
        if lf.kind == "param":
            return self.get_parameter(self.param_refs[lf.ref])  # gathered inside its unit's call, a shard outside
        return super().leaf_tensor(lf, batch)

    def forward(self, inputs: Any = None, target: Any = None) -> torch.Tensor:
        prog = self.program
        env = self._leaves(inputs, target, params=False)  # parameters: looked up as each node runs
        grad_on = torch.is_grad_enabled()
        self._grad_on = grad_on  # a caller's no_grad holds for every node (see StepModule.forward)
        try:
            self._segments(self.segments, env)
        finally:
            torch.set_grad_enabled(grad_on)
            self._node = None
        return env[prog.loss]

    def _segments(self, segs: list[Segment], env: dict) -> None:
        for seg in segs:
            if seg.unit is None:
                self._nodes(seg.start, seg.stop, env)
                continue

            def run(tensors, seg=seg):
                local = dict(env)
                local.update(zip(seg.inputs, tensors, strict=True))
                self._segments(seg.children, local)
                return tuple(local[r] for r in seg.outputs)

            ins = [env[r] for r in seg.inputs]
            outs = self.get_submodule(seg.unit)(run, *ins)
            env.update(zip(seg.outputs, outs, strict=True))

    def _nodes(self, a: int, b: int, env: dict) -> None:
        prog = self.program
        refs = self.param_refs
        for i in range(a, b):
            node = prog.nodes[i]
            self._node = i
            for r in node_inputs(node):
                if r in refs:
                    env[r] = self.get_parameter(refs[r])
            if (node.grad and self._grad_on) != torch.is_grad_enabled():
                torch.set_grad_enabled(node.grad and self._grad_on)
            out = self._run(node, env)
            self._bind(node, out, env, i)
        torch.set_grad_enabled(self._grad_on)


def check_program(program: Program, shapes: dict[str, tuple[list[int], torch.dtype]], batch: dict,
                  constants: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], aliases: dict[str, str],
                  where: str) -> int:
    """Every leaf against what the snapshot holds (parameters by their whole shape), then the meta dry run;
    returns the replay's memory bound (bytes)."""
    meta, values = {}, {}
    for lf in program.leaves:
        try:
            if lf.kind == "param":
                shape, dtype = shapes[aliases.get(lf.name, lf.name)]
            else:
                t = buffers[lf.name] if lf.kind == "buffer" else constants[lf.name] if lf.kind == "constant" \
                    else _batch_leaf(batch, lf.path)
                shape, dtype = list(t.shape), t.dtype
                if not (t.is_floating_point() or t.is_complex()):
                    values[lf.ref] = t
        except (KeyError, IndexError, TypeError) as e:
            raise SnapshotError(f"{where}: invalid step program: {lf.kind} {lf.name!r} is not in the snapshot "
                                f"({type(e).__name__})") from None
        if list(shape) != lf.shape or DTYPES[lf.dtype] != dtype:
            raise SnapshotError(f"{where}: invalid step program: {lf.kind} {lf.name!r} is {list(shape)} {dtype}, "
                                f"the program says {lf.shape} {lf.dtype}")
        meta[lf.ref] = (lf.shape, dtype)
    bound = dry_run(program, meta, values=values)
    program.__dict__.pop("_checked_shapes", None)  # ranks replay on their shards: no per-node shapes
    return bound


def _batch_leaf(batch: dict, path: list | None) -> torch.Tensor:
    obj: Any = batch
    for key in path or ():
        obj = obj[key]
    if not isinstance(obj, torch.Tensor):
        raise TypeError("not a tensor")
    return obj


def local_view(module: nn.Module) -> nn.Module:
    """A plain module holding this rank's shard of every parameter (plain tensors, same storage), under the
    parameters' own names: what the diagnosis rules may look at without starting a collective."""
    view = nn.Module()
    for name, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        mod, leaf = _container(view, name)
        mod.register_parameter(leaf, nn.Parameter(local.detach(), requires_grad=False))
    return view
