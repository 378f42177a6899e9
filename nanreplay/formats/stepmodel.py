"""Running a decoded step program: a module whose forward is the recorded ops, and its dry run.

`StepModule` holds the snapshot's parameters and buffers under their own names (so the
gradient table reads naturally) and, on `forward()`, executes the program node by node
with `torch.ops.aten`: every node is one call the replay's modes see, attributed to the
module and source line recorded at capture (`site()`). Outputs are checked against the
shapes the file declares as they are made, so a lying file cannot allocate more than
`dry_run()` bounded.

`dry_run()` recomputes every node on the meta device (no memory), checks each shape
against the file and returns the replay's peak-memory bound in bytes.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.nn as nn

from nanreplay import torch_internals as ti
from nanreplay.confine import progress
from nanreplay.errors import ReplayError, SnapshotError, op_of
from nanreplay.formats import derivchecks, opchecks  # noqa: F401 - derivchecks adds its checks to opchecks.RULES
from nanreplay.formats.boundaries import Boundaries
from nanreplay.formats.dryrun import arg_shapes, outside_storage, with_output_size
from nanreplay.formats.ops import check_values
from nanreplay.formats.program import DeviceLiteral, Node, Program, Ref, strided_index
from nanreplay.formats.segments import Segment, checkpoint_plan
from nanreplay.replay.frames import RecordedFrame

_FILL_ZERO = frozenset({"aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default",
                        "aten.empty_strided.default"})  # uninitialised memory: replay it as zeros
# outputs a kernel leaves partly uninitialised (heap memory where unused): oneDNN's RNN workspace; CTC's log_alpha
# (`_ctc_loss` fills it only up to each sample's lengths: 1023 of 2100 values were a freed buffer's). Autograd keeps
# the real one for backward; a later node of the program reads zeros.
_UNINITIALISED_OUTPUT = {"aten.mkldnn_rnn_layer.default": (4, 3), "aten._ctc_loss.default": (2, 1),
                         "aten._ctc_loss.Tensor": (2, 1)}
_HALF_TO_FLOAT = frozenset({"aten._softmax.default", "aten._log_softmax.default"})
_RECOMPUTING = [0]  # > 0 while a checkpointed segment recomputes its forward during backward


def recomputing() -> bool:
    """True while a checkpointed replay recomputes forward ops inside backward (they are not the step's)."""
    return _RECOMPUTING[0] > 0


class _Recomputing:
    def __enter__(self):
        _RECOMPUTING[0] += 1

    def __exit__(self, *exc):
        _RECOMPUTING[0] -= 1


def _recompute_context():
    return contextlib.nullcontext(), _Recomputing()


def _container(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    """The submodule that owns `dotted` (created as empty nn.Modules as needed) and the leaf name."""
    *path, leaf = dotted.split(".")
    mod = root
    for part in path:
        sub = mod._modules.get(part)
        if sub is None:
            sub = nn.Module()
            mod.add_module(part, sub)
        mod = sub
    return mod, leaf


class StepModule(Boundaries, nn.Module):
    """The recorded step as a module: parameters and buffers by name, forward = the program."""

    def __init__(self, program: Program, state: dict[str, torch.Tensor], parameters: list[str],
                 aliases: dict[str, str], constants: dict[str, torch.Tensor], *, step_fn: bool = False):
        super().__init__()
        self.__dict__["program"] = program
        self.__dict__["aliases"] = dict(aliases)  # tied name -> the name the program uses
        self.__dict__["step_fn"] = step_fn  # the batch is one object {"batch": ...}, not inputs + target
        self.__dict__["constants"] = dict(constants)
        self.__dict__["policy"] = None  # dtype policy for converted replays (see `converted`)
        self.__dict__["device"] = torch.device("cpu")
        self._node: int | None = None
        params = set(parameters)
        for name, t in state.items():
            if name in aliases:
                continue
            mod, leaf = _container(self, name)
            if name in params:  # the loaded tensors are ours: no copy
                mod.register_parameter(leaf, nn.Parameter(t.detach(), requires_grad=t.is_floating_point()
                                                          or t.is_complex()))
            else:
                mod.register_buffer(leaf, t.detach())
        self.__dict__["_by_name"] = dict(self.named_parameters()) | dict(self.named_buffers())
        self.__dict__["_pristine"] = {n: b.detach().clone() for n, b in self.named_buffers()}
        self.__dict__["_sites"] = {}

    # ---- copies in other dtypes (precision probe, fix verification)
    def __deepcopy__(self, memo):
        new = StepModule.__new__(StepModule)
        nn.Module.__init__(new)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            new.__dict__[k] = v
        new.__dict__["_keep"], new.__dict__["_kept"] = None, ({}, {})  # a copy keeps nothing of this one's
        new.__dict__["_watch"] = None
        new.__dict__["constants"] = {k: v.clone() for k, v in self.constants.items()}
        new._node = None
        for name, p in self._parameters.items():
            new._parameters[name] = None if p is None else nn.Parameter(p.detach().clone(), p.requires_grad)
        for name, b in self._buffers.items():
            new._buffers[name] = None if b is None else b.detach().clone()
        for name, m in self._modules.items():
            new._modules[name] = copy.deepcopy(m, memo)
        new.__dict__["_by_name"] = dict(new.named_parameters()) | dict(new.named_buffers())
        new.__dict__["_pristine"] = {n: b.detach().clone() for n, b in new.named_buffers()}
        new.__dict__["_sites"] = {}
        new.__dict__["_versions"] = {}
        return new

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.__dict__["constants"] = {k: fn(v) for k, v in self.constants.items()}
        self.__dict__["_pristine"] = {k: fn(v) for k, v in self._pristine.items()}
        self.__dict__["_by_name"] = dict(self.named_parameters()) | dict(self.named_buffers())
        self.__dict__["_versions"] = {}
        p = next(iter(self._by_name.values()), None)
        if p is not None:
            self.__dict__["device"] = p.device
        return self

    def set_policy(self, all_map: dict, cast_map: dict) -> None:
        """Replay in other dtypes: a floating dtype the program names becomes `all_map[d]` everywhere, and
        `cast_map[d]` where it is autocast's (the casts autocast inserted, literals and constants that follow
        a tensor autocast made); the caller converts weights, the other constants and the batch."""
        self.__dict__["policy"] = (dict(all_map), dict(cast_map)) if all_map or cast_map else None
        for lf in self.program.leaves:
            t = self.constants.get(lf.name) if lf.cast else None
            if t is not None and t.dtype in cast_map:
                self.constants[lf.name] = t.to(cast_map[t.dtype])

    def train(self, mode: bool = True) -> StepModule:
        self.training = mode  # the mode is baked into the recorded ops
        return self

    # ---- the step
    def forward(self, inputs: Any = None, target: Any = None) -> torch.Tensor:
        """Run the program on this batch (the snapshot's, or a converted copy of it); returns the loss."""
        prog = self.program
        env = self._leaves(inputs, target)
        grad_on = torch.is_grad_enabled()
        segments = self.__dict__.get("_checkpointed")
        try:
            if segments and grad_on:
                self._run_checkpointed(segments, env)
            else:
                self._run_nodes(0, len(prog.nodes), env, grad_on)
        finally:
            torch.set_grad_enabled(grad_on)
            self._node = None
            self.__dict__["_keep"] = None  # only the forward right after keep_boundaries() keeps them
            progress.at(progress.AFTER, -1)  # backward, or whatever runs next, is past the program's nodes
        return env[prog.loss]

    def _leaves(self, inputs: Any, target: Any, *, params: bool = True) -> dict[int, Any]:
        """A replay's starting values: the buffers as captured, then every leaf the program names. Made unseen
        by the replay's call numbering: only the program's own ops are numbered, the same in every replay (a
        second replay of the same copy restores no buffer that the first left as captured)."""
        with ti.function_modes_off():
            return self._leaves_unseen(inputs, target, params)

    def _leaves_unseen(self, inputs: Any, target: Any, params: bool) -> dict[int, Any]:
        self._restore_buffers()
        batch = {"batch": inputs} if self.step_fn else {"inputs": inputs, "target": target}
        env: dict[int, Any] = {}
        for lf in self.program.leaves:
            if params or lf.kind != "param":
                t = self.leaf_tensor(lf, batch)
                env[lf.ref] = t.clone() if lf.kind == "constant" else t  # a replay may write into its constants
        return env

    def _run_nodes(self, a: int, b: int, env: dict, grad_on: bool) -> None:
        dead = self.program.dead_after()
        total = len(self.program.nodes)
        keep = self.__dict__.get("_keep")
        watch = self.__dict__.get("_watch")
        for i in range(a, b):
            if keep:
                self._keep_at(i, env)
            node = self.program.nodes[i]
            self._node = i
            progress.at(progress.REPLAY, i, node.name, total)  # a crash in the kernel below is then named (confine/)
            # grad mode as the step had it (parts under no_grad stay so), never on under a caller's no_grad:
            # a forward-only pass must not build the graph
            if (node.grad and grad_on) != torch.is_grad_enabled():
                torch.set_grad_enabled(node.grad and grad_on)
            try:
                out = self._run(node, env)
            except Exception as e:
                op_of(e, f"{node.name} at node {i}")  # "raised ... in aten.x": which recorded op could not run
                raise
            if watch is not None and i == watch[0]:
                watch[1].append(out)
            with ti.function_modes_off():
                self._bind(node, out, env, i)
            for r in dead[i]:  # no later node reads them: let autograd decide what stays alive
                env.pop(r, None)
        if keep and b == len(self.program.nodes):
            self._keep_at(b, env)

    # ---- replaying in less memory
    def checkpointed(self) -> bool:
        """From now on, replays with grad on run in segments whose activations are recomputed in backward
        instead of kept (`torch.utils.checkpoint`, non-reentrant; `segments.checkpoint_plan` says which): the
        float64 probe of a gradient failure then holds the segments' boundaries and one segment's graph, not
        the whole step's, for one more forward. The loss and gradients are the same (the program's random
        values are recorded constants). False where the program has no segments worth it."""
        self.__dict__["_checkpointed"] = checkpoint_plan(self.program)
        return self.__dict__["_checkpointed"] is not None

    def _run_checkpointed(self, segments: list[Segment], env: dict) -> None:
        from torch.utils.checkpoint import checkpoint

        dead = self.program.dead_after()
        for seg in segments:
            if seg.unit is None:
                self._run_nodes(seg.start, seg.stop, env, True)
                continue
            held = {r: env[r] for r in seg.params}  # looked up by the nodes, not passed through the checkpoint

            def run(*tensors, seg=seg, held=held):
                local = dict(held)
                local.update(zip(seg.inputs, tensors, strict=True))
                self._run_nodes(seg.start, seg.stop, local, True)
                return tuple(local[r] for r in seg.outputs)

            outs = checkpoint(run, *[env[r] for r in seg.inputs], use_reentrant=False, context_fn=_recompute_context)
            env.update(zip(seg.outputs, outs, strict=True))
            for i in range(seg.start, seg.stop):
                for r in dead[i]:
                    env.pop(r, None)

    def _restore_buffers(self) -> None:
        """Each replay starts from the buffers as captured (BatchNorm's running stats change in place)."""
        versions = self.__dict__.setdefault("_versions", {})
        for name, pristine in self._pristine.items():
            t = self._by_name[name]
            if versions.get(name) != t._version:
                with torch.no_grad():
                    t.copy_(pristine)
                versions[name] = t._version

    def leaf_tensor(self, lf, batch: dict) -> torch.Tensor:
        """The tensor a program leaf names (raises KeyError/IndexError/TypeError when it is not there)."""
        if lf.kind in ("param", "buffer"):
            t = self._by_name.get(self.aliases.get(lf.name, lf.name))
            if t is None:
                raise KeyError(lf.name)
            return t
        if lf.kind == "constant":
            return self.constants[lf.name]
        obj: Any = batch
        for key in lf.path or ():
            obj = obj[key]
        if not isinstance(obj, torch.Tensor):
            raise TypeError(f"{lf.name} is not a tensor")
        return obj

    def _arg(self, v: Any, node: Node, env: dict) -> Any:
        if isinstance(v, Ref):
            return env[v]
        if isinstance(v, DeviceLiteral):
            return self.device
        if isinstance(v, torch.dtype):
            return self._dtype(v, node)
        if isinstance(v, list):
            return [self._arg(x, node, env) for x in v]
        return v

    def _dtype(self, d: torch.dtype, node: Node) -> torch.dtype:
        pol = self.policy
        if pol is None or not d.is_floating_point:
            return d
        all_map, cast_map = pol
        if node.cast and d in cast_map:
            return cast_map[d]
        return all_map.get(d, d)

    def _run(self, node: Node, env: dict) -> Any:
        with ti.function_modes_off():  # the checks read values: unseen by the call numbering, as in _leaves
            args, kwargs = self._checked_args(node, env)
        if node.random is not None or node.mask is not None or node.name in _FILL_ZERO:
            return self._run_special(node, args, kwargs)
        if node.view is not None:
            return self._strided(node, *args)
        out = node.op(*args, **kwargs)
        n, k = _UNINITIALISED_OUTPUT.get(node.name, (0, 0))
        if n and isinstance(out, tuple) and len(out) == n:
            with ti.dispatch_modes_off(), torch.no_grad():  # backward keeps the real one, a later node reads zeros
                zeros = torch.zeros_like(out[k])
            out = (*out[:k], zeros, *out[k + 1:])
        return out

    def _strided(self, node: Node, flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """A take that stands for an as_strided (capture/program.py), made the view eager made: a copy has
        another layout, and a sum over it adds in another order (not bit for bit). The view reads exactly the
        elements the index names (checked against the bounds before, here against the strides)."""
        stride, offset = node.view
        if flat.dim() != 1 or (flat.numel() > 1 and flat.stride(0) != 1):
            return node.op(flat, index)  # not the dense flattening capture records: the take, a copy
        with ti.function_modes_off(), ti.dispatch_modes_off(), torch.no_grad():
            same = torch.equal(index, strided_index(list(index.shape), stride, offset, index.device))
        if not same:
            raise SnapshotError(f"invalid step program: node {self._node} ({node.name}): its index is not the "
                                "view its strides describe; nothing was run with it")
        return torch.ops.aten.as_strided.default(flat, list(index.shape), list(stride), flat.storage_offset() + offset)

    def _checked_args(self, node: Node, env: dict) -> tuple[list, dict]:
        args = [self._arg(a, node, env) for a in node.args]
        kwargs = with_output_size(node, {k: self._arg(v, node, env) for k, v in node.kwargs.items()})
        self._check_views(node, args, kwargs)
        try:  # what the op's kernel would trust, with the values this replay computed (formats/opchecks.py)
            opchecks.check(node.op, node.name.split(".")[1], args, kwargs, opchecks.real_values)
        except opchecks.Refused as e:
            raise SnapshotError(f"invalid step program: node {self._node} ({node.name}): {e}; nothing was "
                                "run with it") from None
        refused = check_values(node.op, node.name, args, kwargs)
        if refused:
            raise SnapshotError(f"invalid step program: {node.name}: {refused}")
        if self.policy is not None and node.name in _HALF_TO_FLOAT and len(args) > 2 and args[2]:
            args[2] = args[0].dtype == torch.float16  # half_to_float only applies to half inputs
        return args, kwargs

    def _check_views(self, node: Node, args: list, kwargs: dict) -> None:
        """The kernel runs only on the shapes the dry run checked (an in-place view change through an alias the
        dry run did not model would otherwise reach it), and on views that stay inside their storage."""
        checked = self.program.__dict__.get("_checked_shapes")
        i = self._node
        what = f"invalid step program: node {i} ({node.name})"
        if checked is not None and i is not None and i < len(checked):
            got = arg_shapes(args, kwargs)
            if got != checked[i]:
                raise SnapshotError(f"{what}: its inputs are {[list(s) for s in got]} here but "
                                    f"{[list(s) for s in checked[i]]} in the dry run that checked them (two leaves "
                                    "of the snapshot alias one tensor?); nothing was run with it")
        bad = outside_storage(args, kwargs)
        if bad is not None:
            raise SnapshotError(f"{what}: an input's view reaches past the end of its storage (shape "
                                f"{list(bad.shape)}); nothing was run with it")

    def _run_special(self, node: Node, args: list, kwargs: dict) -> Any:
        """A random op (its recorded value), native_dropout (its recorded mask), an op that makes uninitialised
        memory (zeros)."""
        if node.random is not None:
            value = self.constants[node.random].clone()
            if ti.op_mutated_args(node.op)[0]:  # bernoulli_ / normal_ on a buffer: write the recorded value into it
                with torch.no_grad():
                    args[0].copy_(value)
                return args[0]
            return value
        if node.mask is not None:
            x, p = args[0], float(args[1] if len(args) > 1 else kwargs["p"])  # (a program may name p)
            mask = self.constants[node.mask]
            scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
            out = torch.ops.aten.mul.Tensor(torch.ops.aten.mul.Tensor(x, mask.to(x.dtype)), scale)
            return out, mask
        with ti.dispatch_modes_off(), torch.no_grad():  # made and zeroed out of the replay's sight: it never
            out = node.op(*args, **kwargs)  # sees the uninitialised memory
            out.zero_()
        return out

    def _bind(self, node: Node, out: Any, env: dict, i: int) -> None:
        refs = node.out if isinstance(node.out, list) else [node.out]
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        metas = iter(node.meta)
        for r, t in zip(refs, outs, strict=False):
            if r is None:
                continue
            shape, _dtype = next(metas)
            if not isinstance(t, torch.Tensor) or list(t.shape) != shape:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ReplayError(f"node {i} ({node.name}) made {got}, but the snapshot says {shape}: "
                                  "the step program does not match this torch")
            env[r] = t

    def current_output_shapes(self) -> list[list[int]] | None:
        """The shapes the file declares for the running node's outputs (a kernel's stand-in makes them so)."""
        i = self._node
        return [shape for shape, _dtype in self.program.nodes[i].meta] if i is not None else None

    # ---- attribution for the replay's Recorder
    def current_user_call(self) -> str | None:
        """The user-level call (`F.linear`, `Tensor.sqrt`) the running node was recorded in."""
        i = self._node
        if i is None:
            return None
        node = self.program.nodes[i]
        return self.program.calls[node.call] if node.call else None

    def site(self) -> tuple[str | None, tuple | None, tuple]:
        i = self._node
        if i is None:
            return "<loss>", None, (("<loss>", "<loss>"),)
        s = self._sites.get(i)
        if s is None:
            prog = self.program
            node = prog.nodes[i]
            module = prog.modules[node.module]
            frame = None
            if node.frame is not None:
                f = prog.frames[node.frame]
                frame = RecordedFrame(f["file"], f["line"], f["function"], f["code"], f["context"])
            scopes = prog.scopes_of(node)
            s = self._sites[i] = (module, frame, scopes)
        return s
