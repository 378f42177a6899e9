"""The Recorder and the two thin modes that feed it.

* `_OpMode` (a TorchDispatchMode) sees every aten op, forward and backward;
* `_CallMode` (a TorchFunctionMode) numbers the user-level torch calls, so a
  later pass can rewrite exactly one call site (fix verification);
* global module forward hooks keep the stack of qualified module names.

The modes stay tiny; the Recorder holds state and logic. Per forward op the
Recorder keeps a small `OpRecord` (op, module, user source line, call number);
for each op whose floating output holds a NaN or an Inf it keeps an `Event`
(summaries only — never a reference to an intermediate tensor). A weak map from
non-finite tensors to the event that made them links events by provenance.

Checking an output costs one reduction: a finite sum proves there is no NaN or
Inf. The exact, more expensive checks run only for outputs that fail it, and the
exact counts only for events that can still be on the failure's chain: once a
parameter's gradient, complete, is known non-finite (`grad_done`), the failure's
event is one already recorded, so no later event is its ancestor; later events
record their kinds (by sums), not their counts or input statistics (`counted`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nanreplay import stats
from nanreplay import torch_internals as ti
from nanreplay.enums import Kind, Phase, Role
from nanreplay.replay import copies
from nanreplay.replay.frames import Frame, skip_frames_of, user_frame
from nanreplay.replay.records import Anomaly, Event, OpRecord

ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
_DETACH = torch.ops.aten.detach.default


# ------------------------------------------------------------------ op properties

def _tensors(out: Any):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                yield o


# Outputs that are not values of the step, never checked for NaN/Inf: memory allocated and not yet written
# (torch.empty and its kin, a resize that grows a tensor: whatever the memory held — NaN at times, and always NaN
# under torch.use_deterministic_algorithms' fill_uninitialized_memory), and the workspace an op saves for its own
# backward. An empty's garbage NaN made an event whose storage a later op wrote into: the op that really made a
# NaN there read as its propagation, the empty as the culprit.
UNWRITTEN = frozenset({"aten.empty", "aten.empty_like", "aten.new_empty", "aten.new_empty_strided",
                       "aten.empty_strided", "aten.empty_permuted", "aten.resize_", "aten.resize_as_"})
# Packet -> how many outputs are values; the rest are workspace, never read as an input's kind either (noop.py
# compares the values only): aten._ctc_loss's log_alpha is written only where an alignment reaches (its first
# frame's row is -inf by construction), the rest unwritten.
VALUE_OUTPUTS = {"aten._ctc_loss": 1, **dict.fromkeys(UNWRITTEN, 0)}
_VALUE_COUNT: dict = {}  # op overload -> VALUE_OUTPUTS' answer (on_op asks for every op)


def value_outputs(func) -> int | None:
    """How many of the op's outputs are values (None: all of them)."""
    try:
        return _VALUE_COUNT[func]
    except KeyError:
        n = _VALUE_COUNT[func] = VALUE_OUTPUTS.get(str(func).rsplit(".", 1)[0])
        return n
    except TypeError:  # (not hashable: no op overload)
        return VALUE_OUTPUTS.get(str(func).rsplit(".", 1)[0])


def _written_tensors(func, args: tuple, kwargs: dict):
    """The tensors an in-place op wrote that it did not return (`_foreach_add_` returns nothing)."""
    pos, names = ti.op_mutated_args(func)
    for key, a in list(enumerate(args)) + list(kwargs.items()):
        if (key in pos) if isinstance(key, int) else (key in names):
            yield from _tensors(a)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _scalar_kinds(x: Any) -> tuple[bool, bool]:
    if isinstance(x, float) and not math.isfinite(x):
        return math.isnan(x), math.isinf(x)
    if isinstance(x, complex) and not (math.isfinite(x.real) and math.isfinite(x.imag)):
        return True, True
    return False, False


def _simple(x: Any) -> Any:
    """A JSON-friendly stand-in for a non-tensor op argument."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return stats._num(x)
    if isinstance(x, (list, tuple)) and all(isinstance(v, (int, float, bool)) for v in x):
        return [_simple(v) for v in x]
    return str(x)


# ------------------------------------------------------------------ the recorder


class Recorder:
    """Holds everything one replay observes. The modes and hooks only call into it."""

    def __init__(self, names: dict[int, str], site: Callable[[], tuple[str | None, Frame | None, tuple]] | None = None):
        self.names = names
        self.site = site  # alternative attribution (exported programs); None: module stack + frames
        self.phase = "forward"
        self.module_stack: list[str] = []
        self.ops: list[OpRecord] = []
        self.op_by_seq: dict[int, int] = {}
        self.events: list[Event] = []
        # tensor -> (event, has_nan, has_inf); has_inf is False next to a NaN in events past `counted` (not looked for)
        self.nonfinite = ti.WeakTensorKeyDictionary()
        # Tensors non-finite before the replay began that an op may overwrite in place (optimizer state):
        # their old value was not finite, whatever the map says (filled by the optimizer replay)
        self.bad_leaves = ti.WeakTensorKeyDictionary()
        self.by_storage: dict[int, int] = {}  # storage address -> last event that wrote NaN/Inf there
        self.busy = False
        self.calls = 0
        self.current_call = 0
        self.call_funcs: list[Any] = [None]
        # where calls are aten ops of a recorded program: the user's own call each one belongs to (`F.linear`)
        self.call_label: Callable[[], str | None] | None = None
        self.user_calls: list[str | None] = [None]
        self.node_of: Callable[[], int | None] | None = None  # a step program's running node (OpRecord.node)
        self.intercepts: dict[int, Callable] = {}  # call number -> fn(func, args, kwargs): fix verification
        self.producer = ti.WeakTensorKeyDictionary()  # forward output tensor -> forward op index
        self.workspaces = ti.WeakTensorKeyDictionary()  # workspace outputs (VALUE_OUTPUTS) -> True
        self.proved = ti.WeakTensorKeyDictionary()  # op output -> its version when its sum proved it finite
        self.leaf_names = ti.WeakTensorKeyDictionary()  # batch tensor / parameter -> (kind, name)
        self.activations: list[list] = []  # [module, max |output|, dtype] in forward completion order
        self.grad_shapes: list[list] = []  # [module, output shape, gradient shape or None]
        self.nan_in_backward = False
        self.anomaly: Anomaly | None = None
        self.internal_errors: list[str] = []
        self._site_scopes: tuple = ()  # exported programs: the module calls around the previous op ...
        self._site_out: torch.Tensor | None = None  # ... and its output
        # a parameter's gradient, complete, came out non-finite from an op we saw (grad_done) ...
        self.failure_known = False
        self.stop_at_failure = False  # ... and the replay ends there (run(stop_at_failure=True))
        # events from this index on are past the failure's (see the module's docstring): out counts None, no inputs
        self.counted: int | None = None
        self._inplace: tuple | None = None  # (tensor, op) of an in-place op whose autograd node is not yet known
        self.before: dict | None = None  # _OpMode: an in-place op's inputs as they were before it wrote (by id)

    # ---- called by _OpMode for every aten op
    def on_op(self, func, args: tuple, kwargs: dict, out: Any, seq: int) -> None:
        if self._inplace is not None:  # the node autograd gave the previous op, an in-place one
            t, f = self._inplace
            self._inplace = None
            n = ti.node_sequence_nr(t.grad_fn) if t.grad_fn is not None else None
            if n is not None:
                self.op_by_seq[n] = f
        fwd = None
        view = ti.op_is_view(func)
        if self.phase != "backward":
            fwd = len(self.ops)
            if self.site is not None:
                module, frame, scopes = self.site()
                self._site_exits(scopes, None if func is _DETACH else out)
            else:
                module = self.module_stack[-1] if self.module_stack else ""
                frame = None if view else user_frame(3)
            prod = self.producer
            src = tuple(prod.get(a) for a in args if isinstance(a, torch.Tensor))
            leaves = None
            if None in src and self.leaf_names:
                leaves = tuple(self.leaf_names.get(a) if s is None else None
                               for a, s in zip((a for a in args if isinstance(a, torch.Tensor)), src, strict=True))
            self.ops.append(OpRecord(func, module, frame, self.current_call, src, leaves,
                                     self.node_of() if self.node_of is not None else None))
            if seq - 1 not in self.op_by_seq:  # the node an op creates takes the number just before it
                self.op_by_seq[seq - 1] = fwd
            if self.before is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                # an in-place op (pow_): autograd made its node, then cloned the input it saves (a node too),
                # and sets the node on the tensor only after this returns: read it at the next op
                self._inplace = (out, fwd)
            for t in _tensors(out):
                prod[t] = fwd
        if view and not self._has_nonfinite_input(args):
            if copies.inputs_proved_finite(args, kwargs, self.proved, self.by_storage, _storage_key) is not None:
                copies.prove(self.proved, _tensors(out))  # (a view shares its base's version counter)
            return  # a view of finite data is finite
        if func in copies.COPIES:  # moves values only: finite when its inputs were proved so
            floats = copies.inputs_proved_finite(args, kwargs, self.proved, self.by_storage, _storage_key)
            if floats is not None:
                outs = list(_tensors(out))
                if copies.widens(outs, floats):
                    copies.prove(self.proved, outs)
                    return
        bad = []
        mutates = bool(ti.op_mutated_args(func)[0])
        outs = list(_tensors(out))
        if mutates and not outs:  # in-place ops that return nothing (the foreach family): look at what they wrote
            outs = list(_written_tensors(func, args, kwargs))
        keep = value_outputs(func)
        if keep is not None:
            for t in outs[keep:] if keep else ():  # (an empty's memory is written later: values then)
                self.workspaces[t] = True
            outs = outs[:keep]
        lazy = self.counted is not None
        for t in outs:
            if t.is_complex() and t.numel():  # (rotary embeddings, spectra: checked on their real parts)
                total = _complex_total(t)
            elif not (t.is_floating_point() and t.numel()):
                total = 0.0
            else:
                total = t.sum().item()
            if math.isfinite(total):
                copies.prove(self.proved, (t,))
            else:
                if lazy:  # past the failure's event: the kinds, not the counts
                    n, i = stats.kinds_after(t, total)
                    if n or i:
                        bad.append((t, {"numel": t.numel(), "nan": None, "posinf": None, "neginf": None}, n, i))
                        continue
                else:
                    # exact counts straight away: most such sums are NaN/Inf
                    c = stats.counts(t, (True, True), None if t.is_complex() else total)
                    if c["nan"] or c["posinf"] or c["neginf"]:
                        bad.append((t, c, c["nan"] > 0, c["posinf"] + c["neginf"] > 0))
                        continue
            if mutates:
                self.nonfinite.pop(t, None)  # an in-place op made it finite again
        if bad:
            self._record(func, args, kwargs, bad, fwd)

    def _has_nonfinite_input(self, args: tuple) -> bool:
        nf = self.nonfinite
        return any(isinstance(a, torch.Tensor) and a in nf for a in args)

    def _record(self, func, args, kwargs, bad: list[tuple[torch.Tensor, dict, bool, bool]], fwd: int | None) -> None:
        node = ti.current_autograd_node() if self.phase == "backward" else None
        node_name = node_seq = None
        if node is not None:
            node_name, node_seq = ti.node_name(node), ti.node_sequence_nr(node)
            fwd = self.op_by_seq.get(node_seq)
        lazy = self.counted is not None
        parents: list[int] = []
        in_nan = in_inf = False  # kinds among linked (computed) non-finite inputs
        lit_nan = lit_inf = False  # kinds among literal constants
        inputs: list[torch.Tensor] = []
        scalars: list = []
        mut_pos, mut_names = ti.op_mutated_args(func)
        items = list(enumerate(args)) + list(kwargs.items())
        for key, a in items:
            written = key in mut_pos if isinstance(key, int) else key in mut_names
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if not isinstance(t, torch.Tensor):
                    n, i = _scalar_kinds(t)
                    lit_nan, lit_inf = lit_nan or n, lit_inf or i
                    if t is not None:
                        scalars.append(_simple(t))
                    continue
                inputs.append(t)
                if not (t.is_floating_point() or t.is_complex()) or t in self.workspaces:
                    continue
                hit = self.nonfinite.get(t)
                if hit is not None:  # computed by an op we saw: provenance link
                    parents.append(hit[0])
                    in_nan, in_inf = in_nan or hit[1], in_inf or hit[2]
                    continue
                if (written and t not in self.bad_leaves) or lazy:
                    continue  # its value before this op was finite, or the map would know it (past `counted`:
                    # links through the map only, the role unread: the event is on no chain)
                n, i = stats.kinds(t)
                if not (n or i):
                    continue
                ev = self.by_storage.get(_storage_key(t))
                if ev is not None:  # a view or a saved copy of a tensor we saw made non-finite
                    parents.append(ev)
                    in_nan, in_inf = in_nan or n, in_inf or i
                else:  # made by no op we saw: a constant (wrapped scalar, torch.tensor(inf), inf buffer)
                    lit_nan, lit_inf = lit_nan or n, lit_inf or i
        if lazy:  # past the failure's event: on no chain, so no report shows its counts
            out = {"numel": sum(c["numel"] for _, c, _, _ in bad), "nan": None, "posinf": None, "neginf": None}
        else:
            out = {"numel": 0, "nan": 0, "posinf": 0, "neginf": 0}
            for _, c, _, _ in bad:
                for k, v in c.items():
                    out[k] += v
        has_nan = any(b[2] for b in bad)
        if not parents:
            if lit_nan or lit_inf:
                role = Role.CONVERSION if has_nan and not lit_nan else Role.LITERAL
            else:
                role = Role.ORIGIN
        else:
            role = Role.CONVERSION if has_nan and not (in_nan or lit_nan) else Role.PROPAGATION
        phase = {"backward": Phase.BACKWARD, "optimizer": Phase.OPTIMIZER}.get(self.phase, Phase.FORWARD)
        ev = Event(index=len(self.events), phase=phase,
                   op=str(func), kind=Kind.NAN if has_nan else Kind.INF, role=role,
                   parents=tuple(dict.fromkeys(parents)), out=out, fwd=fwd, node=node_name, node_seq=node_seq,
                   frame=user_frame(4) if self.phase == "backward" else None)
        if ev.frame is not None:
            ev.call = self.current_call
        if role in (Role.ORIGIN, Role.CONVERSION) and not lazy:  # only these can be culprits: worth the statistics
            before = self.before or {}  # an in-place op's input as it was before the op wrote over it
            ev.inputs = [stats.tensor_stats(before.get(id(t), t)) for t in inputs]
            ev.scalars = scalars
        self.events.append(ev)
        for t, _, n, i in bad:
            self.bad_leaves.pop(t, None)  # from now on the map knows it
            self.nonfinite[t] = (ev.index, n, i)
            key = _storage_key(t)
            if key is not None:
                self.by_storage[key] = ev.index
        if has_nan and self.phase == "backward":
            self.nan_in_backward = True

    # ---- once the failure is known: counts no more (`counted`), or stop (run(stop_at_failure=True))
    def grad_done(self, p: torch.Tensor) -> None:
        """A post-accumulate-grad hook: p.grad is complete (AccumulateGrad runs once per backward). When it is
        non-finite and made by an op we saw, the failure's event can no longer change: see `StopReplay`. Its
        event is one recorded already: the failure's (the earliest such, run._failure) is no later, so no event
        from now on is on its chain (`counted`; run() checks it and replays counting everything if not)."""
        if self.failure_known or p.grad is None:
            return
        self.busy = True
        try:
            if (p.grad in self.nonfinite or self.by_storage.get(_storage_key(p.grad)) is not None) \
                    and not stats.finite_fast(p.grad):
                self.failure_known = True
                self.counted = len(self.events)
        finally:
            self.busy = False

    def stop_now(self) -> bool:
        """True at the first op of a backward node (not an AccumulateGrad) after `failure_known`. The failure is
        the non-finite parameter gradient made by the earliest event. AccumulateGrad nodes run before any other
        ready node (their sequence number is the largest), so by then every gradient whose last contribution
        was made up to the armed one's is complete (sibling outputs of the same op included), and any gradient
        still to come is made by a later op: a later event (replay/run.py's `_failure` keeps the earliest)."""
        node = ti.current_autograd_node()
        return node is not None and ti.node_name(node) != ACCUMULATE_GRAD

    # ---- module stack
    def install_module_hooks(self) -> list:
        names, stack = self.names, self.module_stack

        def pre(mod, args):
            n = names.get(id(mod))
            if n is not None:
                stack.append(n)

        def post(mod, args, output):
            n = names.get(id(mod))
            if n is None:
                return
            if stack:
                stack.pop()
            if self.phase != "backward" and not isinstance(output, dict):
                self.busy = True
                try:
                    self.module_output(n, next(_tensors(output), None))
                finally:
                    self.busy = False

        return [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                torch.nn.modules.module.register_module_forward_hook(post)]

    def module_output(self, name: str, t: torch.Tensor | None) -> None:
        """A module call finished with output `t`: its max |activation| and, later, its gradient's shape."""
        if t is None or not t.is_floating_point():
            return
        mx = stats.absmax(t) if t.numel() else 0.0
        self.activations.append([name, mx, stats.dtype_name(t.dtype)])
        if t.requires_grad:
            row = [name, list(t.shape), None]
            self.grad_shapes.append(row)
            t.register_hook(lambda g, row=row: row.__setitem__(2, list(g.shape)))

    def _site_exits(self, scopes: tuple, out: Any) -> None:
        """Module boundaries for programs without module calls (exported): when the module calls
        around consecutive ops change, every call left behind ended with the previous op's output."""
        last = self._site_scopes
        if scopes != last:
            now = {key for key, _ in scopes}
            for key, path in reversed(last):
                if key not in now and not path.startswith("<"):
                    self.module_output(path, self._site_out)
        self._site_scopes = scopes
        if out is not None:  # (autograd's own detach of a saved output is not the module's output)
            self._site_out = next(_tensors(out), None)

    def finish_forward(self) -> None:
        if self.site is not None:
            self.busy = True
            try:
                self._site_exits((), None)
            finally:
                self.busy = False

    # ---- anomaly mode, emulated exactly: the first node whose outputs hold NaN
    def watch_anomaly(self, root) -> list:
        handles = []
        seen = set()
        stack = [root]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
            if ti.node_name(node) == ACCUMULATE_GRAD:
                continue  # returns nothing: anomaly mode has nothing to check there
            handles.append(node.register_hook(self._anomaly_hook(node)))
        return handles

    def _anomaly_hook(self, node):
        def hook(grad_inputs, grad_outputs):
            # No op has produced a NaN in backward yet: no node output can hold one.
            if self.anomaly is not None or not self.nan_in_backward:
                return
            self.busy = True
            try:
                for i, g in enumerate(grad_inputs):
                    if isinstance(g, torch.Tensor) and g.is_floating_point() and bool(torch.isnan(g).any()):
                        self.anomaly = Anomaly(True, ti.node_name(node), ti.node_sequence_nr(node), i)
                        return
            finally:
                self.busy = False
        return hook


class StopReplay(BaseException):  # noqa: N818 - not an error: the failure is known (BaseException: user code lets it pass)
    """Raised by the op mode to end backward early (run(stop_at_failure=True))."""


class _OpMode(ti.TorchDispatchMode):
    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if rec.busy:
            return func(*args, **kwargs)
        if rec.failure_known and rec.stop_at_failure and rec.phase == "backward" and rec.stop_now():
            raise StopReplay
        seq = ti.sequence_nr()
        rec.before = _before_write(rec, func, args) if rec.phase != "backward" else None
        out = func(*args, **kwargs)
        rec.busy = True
        try:
            rec.on_op(func, args, kwargs, out, seq)
        except Exception as e:  # noqa: BLE001 - an observer must not crash what it observes
            rec.internal_errors.append(f"{func}: {type(e).__name__}: {e}")
        finally:
            rec.busy = False
        return out


_MUTATED: dict = {}  # op -> the positions of the arguments it writes (from its schema), read once per op


def _before_write(rec: Recorder, func, args: tuple) -> dict | None:
    """A copy of each finite floating-point tensor an in-place forward op (`x.log_()`, `x.pow_(0.5)`) is about
    to write over, by id: the statistics of its input must be of the value it read, not of what it wrote. In-place
    ops are few in a forward; the copy lives until the op is recorded."""
    pos = _MUTATED.get(func)
    if pos is None:
        pos = _MUTATED[func] = ti.op_mutated_args(func)[0]
    if not pos:
        return None
    out = {}
    for i in pos:
        a = args[i] if i < len(args) else None
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a not in rec.nonfinite:
            out[id(a)] = a.detach().clone()
    return out or None


def _complex_total(t: torch.Tensor) -> float:
    """A complex output's check sum as one float: the sum of its real and imaginary parts (finite exactly when
    both parts' sums are; NaN when either is NaN). Not a count: counts look at `view_as_real(t)` itself."""
    z = t.sum().item()
    return z.real + z.imag if math.isfinite(z.real) and math.isfinite(z.imag) else (
        math.nan if math.isnan(z.real) or math.isnan(z.imag) else math.inf)


class _CallMode(TorchFunctionMode):
    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if rec.busy:
            return func(*args, **kwargs)
        rec.calls += 1
        n = rec.calls
        rec.call_funcs.append(func)
        rec.user_calls.append(rec.call_label() if rec.call_label is not None else None)
        rec.current_call = n
        try:
            fix = rec.intercepts.get(n)
            if fix is not None:
                return fix(func, args, kwargs)
            return func(*args, **kwargs)
        finally:
            rec.current_call = 0


skip_frames_of(_OpMode.__torch_dispatch__, _CallMode.__torch_function__)  # look through the modes' own frames


def call_name(func: Any) -> str:
    """`torch.log`, `Tensor.sqrt`, `F.softmax`: how the user spelled the call."""
    if func is None:
        return ""
    if isinstance(func, ti.OpOverload):
        return f"torch.ops.{func.overloadpacket}"  # exported programs call aten ops directly
    name = getattr(func, "__name__", None) or str(func)
    qual = getattr(func, "__qualname__", name)
    mod = getattr(func, "__module__", None) or ""
    if "TensorBase" in qual or "Tensor." in qual or mod == "torch._tensor":
        return f"Tensor.{name}"
    if mod.startswith("torch.nn.functional"):
        return f"F.{name}"
    if mod.startswith("torch"):
        return f"torch.{name}"
    return name
