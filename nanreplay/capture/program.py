"""Record a training step as a step program: the aten ops it actually executed, on real tensors.

    prog = record_step(lambda: loss_fn(model(x), y), model=model, batch={"inputs": x, "target": y})

The step runs once more under a tiny TorchDispatchMode (every aten op, with its arguments
and outputs) and a TorchFunctionMode (which user-level call and source line ran it), with
module hooks naming the module. The result is straight-line: data-dependent Python control
flow, `.item()` and loops are simply what happened on this batch. Random ops are recorded
as values (dropout masks are stored, never re-drawn), so a replay is exact on any device.

What cannot be replayed as ops is refused here with a reason, never written half-right:
custom `autograd.Function`s and reentrant checkpointing (their backward is Python code),
random ops whose output carries a gradient (other than dropout), ops off the allowlist.
`as_strided` is never in a program (DESIGN.md): over a dense tensor it is recorded as what it reads,
`take` of the tensor flattened in storage order at a constant index (Longformer's overlapping chunks; the restride inside
`adaptive_avg_pool1d`), whose bounds the replay checks. The node carries the view's strides: the replay makes the
same view (a copy's layout would sum in another order downstream: not bit for bit); a later write into it is
refused here, as a program holds no aliasing as_strided.
This module imports only torch (and nanreplay's own torch-only modules).
"""

from __future__ import annotations

import linecache
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nanreplay import torch_internals as ti
from nanreplay.capture import plain
from nanreplay.capture.owned import storage_freed
from nanreplay.formats.ops import ALLOWED_OPS
from nanreplay.formats.program import (
    DROPOUT,
    DTYPE_NAMES,
    LAYOUTS,
    MAX_CONTEXT,
    MAX_TEXT,
    MEMORY_FORMATS,
    SCHEMA,
    encode_float,
    is_random_call,
    strided_index,
)
from nanreplay.replay.frames import skip_frames_of, user_frame
from nanreplay.replay.recorder import call_name

CONTEXT = 4  # source lines kept above and below each recorded line
_LIFT = {"aten.lift_fresh.default", "aten.lift_fresh_copy.default", "aten.lift.default"}
_STRIDED = {"aten.as_strided.default", "aten.as_strided_.default"}
_RRELU = "aten.rrelu_with_noise.default"
_CONVERSIONS = {"to", "half", "float", "double", "bfloat16", "type", "type_as", "_to_copy"}
_NAMED_DTYPE = {"half", "float", "double", "bfloat16"}  # the call itself names its dtype: it never follows one
_DTYPE_GET = torch.Tensor.dtype  # `t.dtype`, which the function mode sees as this descriptor's __get__
_LAYOUT_NAMES = {v: k for k, v in LAYOUTS.items()}
_MEMFMT_NAMES = {v: k for k, v in MEMORY_FORMATS.items()}


class NotRecordable(Exception):
    """The step cannot travel as a program; the message says why (it goes into the snapshot)."""


@dataclass
class Recorded:
    """A recorded step: the program (JSON-able) and the tensors it names."""

    program: dict
    constants: dict[str, torch.Tensor]  # name -> tensor (random values, tensors made outside any op)
    loss: torch.Tensor  # the loss the recording computed (must equal the step's own)
    notes: list[str] = field(default_factory=list)


class _Recorder:
    def __init__(self, leaves: dict[int, tuple[str, str, list | None]]):
        # id(tensor) -> (kind, name, path) for params, buffers and batch tensors, kept alive by the caller
        self.leaf_info = leaves
        self.refs = ti.WeakTensorKeyDictionary()  # tensor -> ref
        self.keep: list[torch.Tensor] = []  # leaves and constants stay alive: ids must not be reused
        self.leaves: list[dict] = []
        self.nodes: list[dict] = []
        self.constants: dict[str, torch.Tensor] = {}
        self.next_ref = 0
        self.modules: list[str] = [""]
        self.module_index = {"": 0}
        self.module_stack: list[int] = []  # scope ids of the module calls running now
        self.scopes: list[list[int]] = []  # scope id -> [module index, parent scope id or -1]
        self.frames: list[dict] = []
        self.frame_index: dict[tuple, int] = {}
        self.calls: list[str] = [""]
        self.call_funcs: list[Any] = [None]
        self.current_call = 0
        self.call_autocast: torch.dtype | None = None  # autocast's dtype when the current user-level call began
        self.call_follows: set[torch.dtype] = set()  # dtypes of the call's tensor arguments after the first
        self.read_dtypes: set[torch.dtype] = set()  # dtypes the step read off a float tensor (`q.dtype`)
        self.phase = "forward"
        self.busy = False
        self.error: str | None = None
        self.watch: Any = None  # sees every op of the step, recordable or not (capture/rerun.py RandomWatch)
        self.strided = ti.WeakTensorKeyDictionary()  # outputs of as_strided recorded as take: copies, not views

    # ---- refs
    def _new_ref(self) -> int:
        r = self.next_ref
        self.next_ref += 1
        return r

    def ref_of(self, t: torch.Tensor) -> int:
        r = self.refs.get(t)
        if r is not None:
            return r
        info = self.leaf_info.get(id(t))
        r = self._new_ref()
        if info is not None:
            kind, name, path = info
        else:
            kind, name, path = "constant", f"c{len(self.constants)}", None
            self.constants[name] = t.detach().clone()
        leaf = {"ref": r, "kind": kind, "name": name, "shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype]}
        if path is not None:
            leaf["path"] = path
        self.leaves.append(leaf)
        self.refs[t] = r
        self.keep.append(t)
        return r

    def constant(self, t: torch.Tensor, prefix: str) -> str:
        name = f"{prefix}{len(self.constants)}"
        self.constants[name] = t.detach().clone()
        return name

    # ---- arguments
    def enc(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {"r": self.ref_of(x)}
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return encode_float(x)
        if isinstance(x, complex):
            return {"c": [encode_float(x.real), encode_float(x.imag)]}
        if isinstance(x, (list, tuple)):
            return [self.enc(v) for v in x]
        if isinstance(x, torch.dtype):
            if x not in DTYPE_NAMES:
                raise NotRecordable(f"dtype {x} is not supported in a step program")
            return {"dtype": DTYPE_NAMES[x]}
        if isinstance(x, torch.device):
            return {"device": x.type}
        if isinstance(x, torch.layout) and x in _LAYOUT_NAMES:
            return {"layout": _LAYOUT_NAMES[x]}
        if isinstance(x, torch.memory_format) and x in _MEMFMT_NAMES:
            return {"memory_format": _MEMFMT_NAMES[x]}
        raise NotRecordable(f"an argument of type {type(x).__name__} cannot be stored as data")

    # ---- frames and modules
    def frame_of(self, fr) -> int | None:
        if fr is None:
            return None
        file, line = fr[0], fr[1]
        key = (file, line)
        i = self.frame_index.get(key)
        if i is None:
            i = self.frame_index[key] = len(self.frames)
            self.frames.append(frame_record(file, line, fr[2]))
        return i

    def module_id(self, name: str) -> int:
        i = self.module_index.get(name)
        if i is None:
            i = self.module_index[name] = len(self.modules)
            self.modules.append(name)
        return i

    # ---- one op
    def on_op(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        name = str(func)
        tensors_out = [t for t in _flat_tensors(out)]
        if not tensors_out:
            return  # .item(), comparisons returning bools: nothing downstream refers to them
        if name in _LIFT:  # torch.tensor(data): its value is a constant
            self.refs[out] = self.ref_of_constant(out, self._follows_autocast([out.dtype]))
            return
        if self.strided:
            self._no_write_into_strided(func, args, kwargs)
        if name in _STRIDED:
            self._as_take(args, kwargs, out)
            return
        if name == _RRELU:
            self._rrelu(args, kwargs, out)
            return
        if name not in ALLOWED_OPS and name.endswith(".out") and self._out_variant(func, args, kwargs, out):
            return
        if name not in ALLOWED_OPS:
            raise NotRecordable(f"the step uses {name}, which is not on nanreplay's allowlist of pure tensor ops")
        node: dict[str, Any] = {"op": name}
        if is_random_call(func, args, kwargs) and name != DROPOUT:
            node["random"] = self.constant(out if isinstance(out, torch.Tensor) else tensors_out[0], "rand")
            if len(tensors_out) != 1:
                raise NotRecordable(f"the random op {name} returns several tensors")
        elif name == DROPOUT:
            node["mask"] = self.constant(out[1], "mask")
        node["args"] = [self.enc(a) for a in args]
        if kwargs:
            node["kwargs"] = {k: self.enc(v) for k, v in kwargs.items()}
        node["out"], node["meta"] = self._outputs(out)
        if not torch.is_grad_enabled() and not ti.in_module_hook_function():  # (its views are on the graph)
            node["grad"] = False
        if self._autocast_cast(name, kwargs) or self._follows_autocast(_dtype_literals(args, kwargs)):
            node["cast"] = True
        if self.phase == "loss":
            node["module"] = self.module_id("<loss>")
        elif self.module_stack:
            scope = self.module_stack[-1]
            node["scope"] = scope
            if self.scopes[scope][0]:
                node["module"] = self.scopes[scope][0]
        frame = self.frame_of(user_frame(2))
        if frame is not None:
            node["frame"] = frame
        if self.current_call:
            node["call"] = self.current_call
        self.nodes.append(node)

    def _as_take(self, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        """as_strided(x, size, stride, offset) of a dense x, recorded as take(x in storage order .view(-1), index)."""
        x, size, stride = args[0], list(args[1]), list(args[2])
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
        offset = x.storage_offset() if offset is None else int(offset)
        perm = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))  # storage order (a transposed x: Longformer)
        with torch.no_grad():
            dense = torch.ops.aten.permute.default(x, perm)
        if not dense.is_contiguous():
            raise NotRecordable("the step uses as_strided on a tensor with gaps or overlaps, which a program cannot hold")
        with torch.no_grad():
            index = strided_index(size, stride, offset - x.storage_offset())
            if index.numel() and not (0 <= int(index.min()) and int(index.max()) < x.numel()):
                raise NotRecordable("the step uses as_strided beyond the elements of its tensor")
            flat = torch.ops.aten.view.default(dense, [-1])
        self.keep += [dense, flat]
        if perm != list(range(x.dim())):
            self.on_op(torch.ops.aten.permute.default, (x, perm), {}, dense)
        else:
            dense = x
        self.on_op(torch.ops.aten.view.default, (dense, [-1]), {}, flat)
        self.on_op(torch.ops.aten.take.default, (flat, index), {}, out)
        self.nodes[-1]["view"] = [stride, max(offset - x.storage_offset(), 0)]  # the replay makes eager's view: same layout
        self.strided[out] = True

    def _out_variant(self, func, args: tuple, kwargs: dict, out: Any) -> bool:
        """`torch.cumsum(x, 0, out=buf)` (torch_geometric's `cumsum` writes into a slice this way): `out=` overloads
        are never in a program, so it is recorded as the op's functional overload, then `buf.copy_(result)` — the
        same values, where `buf` already has the result's shape and dtype (an `out=` that would resize is not)."""
        target = kwargs.get("out")
        if not isinstance(target, torch.Tensor) or target is not out:
            return False
        packet = getattr(torch.ops.aten, str(func).split(".")[1], None)
        schema = ti.op_schema(func)
        if packet is None or schema is None:
            return False
        want = [a.name for a in schema.arguments if a.name != "out"]
        rest = {k: v for k, v in kwargs.items() if k != "out"}
        for ov in packet.overloads():
            functional = getattr(packet, ov)
            fs = ti.op_schema(functional)
            if ov == "out" or fs is None or [a.name for a in fs.arguments] != want or str(functional) not in ALLOWED_OPS:
                continue
            with torch.no_grad():
                result = functional(*args, **rest)
            if not isinstance(result, torch.Tensor) or result.shape != target.shape or result.dtype != target.dtype:
                return False
            self.keep.append(result)
            self.on_op(functional, args, rest, result)
            self.on_op(torch.ops.aten.copy_.default, (target, result), {}, target)
            return True
        return False

    def _rrelu(self, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        """nn.RReLU: in training, the slopes it drew are recorded values, like a dropout mask — noise.copy_(slopes),
        then x * noise (the kernel's own product: exact, and its gradient is the kernel's grad * noise); in eval,
        leaky_relu at the mean slope, as the kernel computes it."""
        a = dict(zip(("self", "noise", "lower", "upper", "training"), args, strict=False)) | kwargs
        x, noise = a["self"], a["noise"]
        lower, upper = float(a.get("lower", 0.125)), float(a.get("upper", 1 / 3))
        if not a.get("training", False):
            self.on_op(torch.ops.aten.leaky_relu.default, (x, (lower + upper) / 2), {}, out)
            return
        slopes = noise.detach().clone()
        self.on_op(torch.ops.aten.copy_.default, (noise, slopes), {}, noise)
        self.on_op(torch.ops.aten.mul.Tensor, (x, noise), {}, out)

    def _no_write_into_strided(self, func, args: tuple, kwargs: dict) -> None:
        pos, names = ti.op_mutated_args(func)
        written = [args[i] for i in pos if i < len(args)] + [kwargs[k] for k in names if k in kwargs]
        for t in written:
            if isinstance(t, torch.Tensor) and (t in self.strided or (t._base is not None and t._base in self.strided)):
                raise NotRecordable("the step writes into an as_strided view, which a program replays as a copy")

    def ref_of_constant(self, t: torch.Tensor, cast: bool = False) -> int:
        self.refs.pop(t, None)
        r = self._new_ref()
        name = self.constant(t, "c")
        leaf = {"ref": r, "kind": "constant", "name": name, "shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype]}
        if cast:
            leaf["cast"] = True
        self.leaves.append(leaf)
        self.keep.append(t)
        return r

    def _outputs(self, out: Any) -> tuple[Any, list]:
        meta = []

        def one(t):
            if not isinstance(t, torch.Tensor):
                return None
            if t.dtype not in DTYPE_NAMES:
                raise NotRecordable(f"an op returned dtype {t.dtype}, which a step program cannot hold")
            r = self._new_ref()
            self.refs[t] = r  # in-place ops return their argument: it now answers to the new ref
            meta.append([list(t.shape), DTYPE_NAMES[t.dtype]])
            return r

        if isinstance(out, (tuple, list)):
            return [one(t) for t in out], meta
        return one(out), meta

    def _call_base(self) -> str:
        fn = self.call_funcs[self.current_call] if self.current_call < len(self.call_funcs) else None
        return getattr(fn, "__name__", "") or ""

    def _autocast_cast(self, name: str, kwargs: dict) -> bool:
        """A dtype-only _to_copy that autocast inserted (not the user's own .to()/.half())."""
        if name != "aten._to_copy.default" or set(kwargs) - {"dtype"} or "dtype" not in kwargs:
            return False
        return self.call_autocast is not None and self._call_base() not in _CONVERSIONS

    def _follows_autocast(self, dtypes: list[torch.dtype]) -> bool:
        """A dtype literal that stands for autocast's dtype: under autocast, equal to it, and taken from a float
        tensor — read off one during the step (`torch.zeros(..., dtype=q.dtype)`, `x.to(q.dtype)`) or given as
        one (`x.type_as(q)`) — in a call that does not name its dtype itself (`.half()`). A replay in another
        dtype maps it as it maps autocast's own casts; kept as recorded, a bf16/fp32/fp64 replay would mix it
        with the tensors it was meant to match."""
        low = self.call_autocast
        if low is None or low not in dtypes or self._call_base() in _NAMED_DTYPE:
            return False
        return low in self.read_dtypes or low in self.call_follows


def autocast_enabled() -> bool:
    """Is autocast on for any device? (Asked above the dispatcher: below it autocast reads as off.)"""
    return autocast_dtype() is not None


def autocast_dtype() -> torch.dtype | None:
    """The dtype of the autocast that is on (the first device that has one on), or None."""
    for device in ("cpu", "cuda", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(device):
                return torch.get_autocast_dtype(device)
        except Exception:  # noqa: BLE001,S112 - a device type this torch does not know
            continue
    return None


def _dtype_literals(args: tuple, kwargs: dict) -> list[torch.dtype]:
    """The floating dtypes among an op's literal arguments."""
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.dtype) and v.is_floating_point]


def _flat_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def frame_record(file: str, line: int, function: str) -> dict:
    """The source line and its context, read now, on the machine that ran the code."""
    code = linecache.getline(file, line).rstrip("\n")
    rec: dict[str, Any] = {"file": file[:1000], "line": line, "function": function[:MAX_TEXT],
                           "code": code.strip()[:10 * MAX_TEXT] or None}
    if code and file.endswith(".py") and os.path.isfile(file):
        lines = linecache.getlines(file)
        n = min(CONTEXT, MAX_CONTEXT)
        lo, hi = max(1, line - n), min(len(lines), line + n)
        rec["context"] = [lo, [ln.rstrip("\n")[:10 * MAX_TEXT] for ln in lines[lo - 1:hi]]]
    return rec


class _OpMode(ti.TorchDispatchMode):
    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.rec
        if rec.busy:
            return out
        if rec.watch is not None:
            rec.watch.see(func, args, kwargs, out)
        if rec.error is not None:
            return out
        rec.busy = True
        try:
            rec.on_op(func, args, kwargs, out)
        except NotRecordable as e:
            rec.error = str(e)
        except Exception as e:  # noqa: BLE001 - never break the user's step; say why the program is missing
            rec.error = f"recording failed at {func}: {type(e).__name__}: {e}"
        finally:
            rec.busy = False
        return out


class _CallMode(TorchFunctionMode):
    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if getattr(func, "__self__", None) is _DTYPE_GET:  # `t.dtype`: no op runs; a literal may follow it
            out = func(*args, **kwargs)
            if isinstance(out, torch.dtype) and out.is_floating_point and not rec.busy:
                rec.read_dtypes.add(out)
            return out
        if rec.busy or rec.current_call:
            return func(*args, **kwargs)  # only the outermost torch call of the user's line counts
        rec.call_funcs.append(func)
        rec.calls.append(call_name(func))
        rec.current_call = len(rec.calls) - 1
        rec.call_autocast = autocast_dtype()
        rec.call_follows = {t.dtype for t in (*args[1:], *kwargs.values()) if isinstance(t, torch.Tensor)}
        try:
            return func(*args, **kwargs)
        finally:
            rec.current_call = 0


skip_frames_of(_OpMode.__torch_dispatch__, _CallMode.__torch_function__)


@dataclass
class ModuleHooks:
    """Work done around each module call while recording, unseen by the recorder.

    `before(module)` runs first (FSDP2: gather a unit's parameters) and returns further leaves,
    {id(tensor): (kind, name, None)}, for the tensors it made visible; `after(module)` runs once
    the call returned (FSDP2: free them again). Ops either of them runs are not part of the program.
    """

    before: Callable[[torch.nn.Module], dict[int, tuple[str, str, list | None]] | None]
    after: Callable[[torch.nn.Module], None]


FREED = ("a batch tensor no longer holds its data: the step freed its storage (a memory-saving layer, e.g. "
         "torch_geometric's GroupAddRev, resizes its inputs' storage to 0), so the step cannot run again or be stored")


def record_step(forward: Callable[[], Any], loss: Callable[[Any], torch.Tensor], *, model: torch.nn.Module,
                batch: dict[str, Any], hooks: ModuleHooks | None = None, watch: Any = None) -> Recorded:
    """Run `loss(forward())` once under the recorder; the program or NotRecordable(why).

    `watch.see(func, args, kwargs, out)` is told every op the step runs, also after one that cannot be recorded."""
    leaves: dict[int, tuple[str, str, list | None]] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        leaves.setdefault(id(p), ("param", name, None))
    for name, b in model.named_buffers(remove_duplicate=True):
        leaves.setdefault(id(b), ("buffer", name, None))
    for path, t in _batch_tensors(batch):
        if storage_freed(t):
            raise NotRecordable(FREED)
        leaves.setdefault(id(t), ("batch", _path_name(path), path))
    rec = _Recorder(leaves)
    rec.watch = watch
    names = {id(m): n for n, m in model.named_modules()}
    stack = rec.module_stack

    def pre(mod, args):
        n = names.get(id(mod))
        if n is not None:
            if hooks is not None:
                _unseen(rec, lambda: [rec.leaf_info.setdefault(k, v) for k, v in (hooks.before(mod) or {}).items()])
            rec.scopes.append([rec.module_id(n), stack[-1] if stack else -1])
            stack.append(len(rec.scopes) - 1)

    def post(mod, args, output):
        if names.get(id(mod)) is not None:
            if stack:
                stack.pop()
            if hooks is not None:
                _unseen(rec, lambda: hooks.after(mod))

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
               torch.nn.modules.module.register_module_forward_hook(post)]
    try:
        with _CallMode(rec), _OpMode(rec):
            out = forward()
            rec.phase = "loss"
            stack.clear()
            loss_t = loss(out)
    finally:
        for h in handles:
            h.remove()
    if rec.error is not None:
        raise NotRecordable(rec.error)
    if not isinstance(loss_t, torch.Tensor) or loss_t.numel() != 1:
        raise NotRecordable("the step did not return a scalar loss tensor")
    loss_ref = rec.refs.get(loss_t)
    if loss_ref is None:
        raise NotRecordable("the loss was not computed by any recorded op")
    custom = _custom_functions(loss_t)
    if custom:
        raise NotRecordable(f"the step uses custom autograd.Function(s) {', '.join(custom)} (or reentrant "
                            "checkpointing), whose backward is Python code a program cannot hold")
    cut = _gradient_cut(loss_t, rec, loss_ref) if hooks is None else []  # (FSDP2's hooks gather other tensors)
    if cut:
        raise NotRecordable(f"the program would not give {', '.join(cut[:3])}{' ...' if len(cut) > 3 else ''} the "
                            "gradient the step gave it (an op it recorded with grad off is on the step's graph)")
    program = {"schema": SCHEMA, "leaves": rec.leaves, "nodes": rec.nodes, "loss": loss_ref,
               "modules": rec.modules, "scopes": rec.scopes, "frames": rec.frames, "calls": rec.calls}
    return Recorded(program, rec.constants, loss_t)


def _unseen(rec: _Recorder, fn: Callable[[], Any]) -> None:
    """Run fn with the recorder looking away (its ops are not the step's)."""
    was = rec.busy
    rec.busy = True
    try:
        fn()
    finally:
        rec.busy = was


def _gradient_cut(loss: torch.Tensor, rec: _Recorder, loss_ref: int) -> list[str]:
    """The parameters the step's own graph gives a gradient and the program's would not: a replay would leave them
    without one, and a NaN gradient would come out "not reproduced" (the views autograd makes for a module's
    backward hooks, under no_grad, were one such op). Over-approximates the program's paths (every input of a
    node that needs a gradient counts), so it never flags a parameter the replay does reach; a program that writes
    in place is not checked (its writes through views would need alias tracking)."""
    if any(n["op"].rsplit(".", 1)[0].endswith("_") for n in rec.nodes):
        return []  # a write through a view (copy_ into a slice) reaches its base's later readers: not followed here
    ids = {id(v) for v in map(ti.accumulated_variable, ti.autograd_nodes(loss.grad_fn)) if v is not None}
    eager = {info[1] for i, info in rec.leaf_info.items() if info[0] == "param" and i in ids}
    need = {loss_ref}
    for node in reversed(rec.nodes):
        if node.get("grad") is not False and need.intersection(_refs(node["out"], outs=True)):
            need.update(_refs(node["args"]), _refs(node.get("kwargs")))
    return sorted(lf["name"] for lf in rec.leaves if lf["kind"] == "param" and lf["name"] in eager
                  and lf["ref"] not in need)


def _refs(v: Any, outs: bool = False) -> list[int]:
    """The refs in a node's encoded arguments ({"r": n}), or in its outputs (plain ints, with `outs`)."""
    if outs and isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, dict):
        return [v["r"]] if isinstance(v.get("r"), int) and len(v) == 1 else [r for x in v.values() for r in _refs(x)]
    if isinstance(v, list):
        return [r for x in v for r in _refs(x, outs)]
    return []


def _custom_functions(loss: torch.Tensor) -> list[str]:
    found: list[str] = []
    for node in ti.autograd_nodes(loss.grad_fn):
        if ti.is_custom_function_node(node):
            name = type(node).__name__.removesuffix("Backward")
            if name not in found:
                found.append(name)
    return found


def _batch_tensors(obj: Any, path: tuple = ()):
    if isinstance(obj, torch.Tensor):
        yield list(path), obj
    elif isinstance(obj, dict):
        for k, v in obj.items():  # the key the snapshot's copy of the batch has (snapshot.cpu_copy)
            yield from _batch_tensors(v, path + (plain.batch_key(k),))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _batch_tensors(v, path + (i,))


def _path_name(path: list) -> str:
    head, rest = (str(path[0]), path[1:]) if path and isinstance(path[0], str) else ("batch", path)
    return head + "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in rest)

