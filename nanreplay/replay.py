"""Instrumented replay of one training step: forward, loss and backward.

Three small observers feed one `Recorder`:

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
Inf. The exact, more expensive checks run only for outputs that fail it.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import math
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from nanreplay import stats
from nanreplay.errors import AnalysisError, NanReplayError, first_line

try:  # the autograd sequence number links a forward op to its backward node
    from torch._C._autograd import _get_sequence_nr
except ImportError:  # pragma: no cover - very old torch: no backward attribution
    def _get_sequence_nr() -> int:
        return -1

Frame = tuple  # (file, line, function, code-or-None)

ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
_DETACH = torch.ops.aten.detach.default


# ------------------------------------------------------------------ records


@dataclass(slots=True)
class OpRecord:
    """One forward aten op: enough to attribute it and its backward node."""

    op: Any  # the OpOverload; stringified only when needed
    module: str
    frame: Frame | None
    call: int  # number of the user-level torch call that ran it (0: none)
    src: tuple  # per tensor argument: the forward op that produced it (None: a leaf or unknown)


@dataclass(slots=True)
class Event:
    """An op whose floating output held a NaN or an Inf."""

    index: int
    phase: str  # "forward" | "backward" (the loss counts as forward)
    op: str
    kind: str  # "nan" | "inf"
    role: str  # "literal" | "origin" | "conversion" | "propagation"
    parents: tuple[int, ...]
    out: dict  # numel, nan, posinf, neginf
    fwd: int | None  # forward op record: the op itself, or the op whose gradient this is
    node: str | None = None  # autograd node running the op (backward)
    node_seq: int | None = None
    inputs: list[dict] | None = None  # input stats, for every event that can be a culprit
    scalars: list | None = None  # non-tensor arguments (exponents, eps, dims), same events
    frame: Frame | None = None  # backward only: the user's own line, when backward ran Python code
                                 # (a custom autograd.Function's backward, a tensor hook) ...
    call: int = 0  # ... and the number of the user-level call that ran it there


@dataclass
class Failure:
    """What broke the step: the loss, or (finite loss) a parameter gradient."""

    what: str  # "loss" | "gradient"
    name: str  # "loss" or the parameter name
    kind: str
    event: int | None  # the event that produced it


@dataclass
class Anomaly:
    """What torch.autograd.set_detect_anomaly(True) would have done."""

    raises: bool
    node: str | None = None
    node_seq: int | None = None
    output: int | None = None

    @property
    def message(self) -> str | None:
        if not self.raises:
            return None
        return f"Function '{self.node}' returned nan values in its {self.output}th output."


@dataclass
class Step:
    """The result of one instrumented replay."""

    loss: float | None
    events: list[Event]
    ops: list[OpRecord]
    op_by_seq: dict[int, int]
    failure: Failure | None
    anomaly: Anomaly | None
    grads: list[dict]  # per-parameter gradient statistics (the seed's walk)
    call_names: list[str] = field(default_factory=list)
    internal_errors: list[str] = field(default_factory=list)
    backward_error: str | None = None
    activations: list[list] = field(default_factory=list)
    grad_shapes: list[list] = field(default_factory=list)

    def module_of(self, ev: Event) -> str | None:
        return self.ops[ev.fwd].module if ev.fwd is not None else None

    def frame_of(self, ev: Event) -> Frame | None:
        """The line to blame: where the op itself ran if that was user code, else its forward call."""
        return ev.frame or self.forward_frame_of(ev)

    def forward_frame_of(self, ev: Event) -> Frame | None:
        return self.ops[ev.fwd].frame if ev.fwd is not None else None

    def forward_op_of(self, ev: Event) -> str | None:
        return str(self.ops[ev.fwd].op) if ev.fwd is not None else None

    def call_of(self, ev: Event) -> int:
        if ev.frame is not None:
            return ev.call
        return self.ops[ev.fwd].call if ev.fwd is not None else 0


# ------------------------------------------------------------------ source lines

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"] + os.sep, os.path.dirname(os.__file__) + os.sep})
_USER, _SKIP, _STOP = 0, 1, 2
_frame_kind: dict[Any, int] = {}


def _classify(filename: str) -> int:
    if filename.startswith(_OWN_DIR):
        return _STOP  # nanreplay's own driver code: there is no user line above this
    if filename.startswith(_TORCH_DIR) or filename.startswith(_STDLIB_DIRS):
        return _SKIP
    if filename.startswith(("<frozen", "<eval_with_key")) or "site-packages/torch/" in filename:
        return _SKIP
    return _USER


def user_frame(depth: int = 2) -> Frame | None:
    """The innermost frame outside torch and the stdlib: the user's line."""
    f = sys._getframe(depth)
    kinds = _frame_kind
    while f is not None:
        code = f.f_code
        k = kinds.get(code)
        if k is None:
            k = kinds[code] = _classify(code.co_filename)
        if k == _USER:
            return (code.co_filename, f.f_lineno, code.co_name, None)
        if k == _STOP:
            return None
        f = f.f_back
    return None


@functools.lru_cache(maxsize=256)
def local_copy(path: str) -> str:
    """The file here that a path recorded on another machine (or checkout) most likely refers to.

    A snapshot from /home/alice/proj/pkg/model.py analyzed in a checkout of proj finds
    ./pkg/model.py: the longest tail of the recorded path that exists below the current
    folder. Where the recorded path itself exists (another checkout on this machine), a
    local file must share at least its folder and name to be preferred. Falls back to
    the recorded path.
    """
    if not os.path.isabs(path):
        return path
    try:
        if not os.path.relpath(path).startswith(".."):
            return path  # already below the current folder
    except ValueError:
        pass
    parts = path.replace("\\", "/").split("/")
    shortest = 2 if os.path.exists(path) else 1
    for k in range(min(len(parts) - 1, 6), shortest - 1, -1):
        cand = os.path.join(*parts[-k:])
        if os.path.isfile(cand):
            return cand
    return path


def frame_json(frame: Frame | None) -> dict | None:
    if frame is None:
        return None
    recorded, line, func, code = frame
    file = local_copy(recorded)
    if file != recorded and code is not None and linecache.getline(file, line).strip() != code.strip():
        file = recorded  # the local copy has changed at that line: it is not the code that ran
    if code is None:
        code = linecache.getline(file, line).strip() or None
    shown = file
    try:
        rel = os.path.relpath(file)
        if not rel.startswith(".."):
            shown = rel
    except ValueError:
        pass
    out = {"file": shown, "line": line, "code": code, "function": func, "path": file}
    if file != recorded:
        out["recorded_path"] = recorded
    return out


# ------------------------------------------------------------------ op properties

_view_cache: dict[Any, bool] = {}
_mutated_cache: dict[Any, tuple[frozenset, frozenset]] = {}


def _is_view(func) -> bool:
    v = _view_cache.get(func)
    if v is None:
        v = _view_cache[func] = bool(getattr(func, "is_view", False))
    return v


def _mutated(func) -> tuple[frozenset, frozenset]:
    """(positions, keyword names) of the arguments an op writes to."""
    m = _mutated_cache.get(func)
    if m is None:
        pos, names = set(), set()
        schema = getattr(func, "_schema", None)
        for i, a in enumerate(schema.arguments if schema is not None else ()):
            if a.alias_info is not None and a.alias_info.is_write:
                pos.add(i)
                names.add(a.name)
        m = _mutated_cache[func] = (frozenset(pos), frozenset(names))
    return m


def _tensors(out: Any):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                yield o


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
        self.nonfinite = WeakTensorKeyDictionary()  # tensor -> (event, has_nan, has_inf)
        self.by_storage: dict[int, int] = {}  # storage address -> last event that wrote NaN/Inf there
        self.busy = False
        self.calls = 0
        self.current_call = 0
        self.call_funcs: list[Any] = [None]
        self.intercepts: dict[int, Callable] = {}  # call number -> fn(func, args, kwargs): fix verification
        self.producer = WeakTensorKeyDictionary()  # forward output tensor -> forward op index
        self.activations: list[list] = []  # [module, max |output|, dtype] in forward completion order
        self.grad_shapes: list[list] = []  # [module, output shape, gradient shape or None]
        self.nan_in_backward = False
        self.anomaly: Anomaly | None = None
        self.internal_errors: list[str] = []
        self._site_scopes: tuple = ()  # exported programs: the module calls around the previous op ...
        self._site_out: torch.Tensor | None = None  # ... and its output

    # ---- called by _OpMode for every aten op
    def on_op(self, func, args: tuple, kwargs: dict, out: Any, seq: int) -> None:
        fwd = None
        view = _is_view(func)
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
            self.ops.append(OpRecord(func, module, frame, self.current_call, src))
            if seq - 1 not in self.op_by_seq:  # the node an op creates takes the number just before it
                self.op_by_seq[seq - 1] = fwd
            for t in _tensors(out):
                prod[t] = fwd
        if view and not self._has_nonfinite_input(args):
            return  # a view of finite data is finite
        bad = []
        mutates = bool(_mutated(func)[0])
        for t in _tensors(out):
            if t.is_floating_point() and t.numel() and not math.isfinite(t.sum().item()):
                c = stats.counts(t, (True, True))  # exact counts straight away: most such sums are NaN/Inf
                if c["nan"] or c["posinf"] or c["neginf"]:
                    bad.append((t, c))
                    continue
            if mutates:
                self.nonfinite.pop(t, None)  # an in-place op made it finite again
        if bad:
            self._record(func, args, kwargs, bad, fwd)

    def _has_nonfinite_input(self, args: tuple) -> bool:
        nf = self.nonfinite
        return any(isinstance(a, torch.Tensor) and a in nf for a in args)

    def _record(self, func, args, kwargs, bad: list[tuple[torch.Tensor, dict]], fwd: int | None) -> None:
        node = torch._C._current_autograd_node() if self.phase == "backward" else None
        node_name = node_seq = None
        if node is not None:
            node_name, node_seq = node.name(), node._sequence_nr()
            fwd = self.op_by_seq.get(node_seq)
        parents: list[int] = []
        in_nan = in_inf = False  # kinds among linked (computed) non-finite inputs
        lit_nan = lit_inf = False  # kinds among literal constants
        inputs: list[torch.Tensor] = []
        scalars: list = []
        mut_pos, mut_names = _mutated(func)
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
                if not t.is_floating_point():
                    continue
                hit = self.nonfinite.get(t)
                if hit is not None:  # computed by an op we saw: provenance link
                    parents.append(hit[0])
                    in_nan, in_inf = in_nan or hit[1], in_inf or hit[2]
                    continue
                if written:
                    continue  # its value before this op was finite, or the map would know it
                n, i = stats.kinds(t)
                if not (n or i):
                    continue
                ev = self.by_storage.get(_storage_key(t))
                if ev is not None:  # a view or a saved copy of a tensor we saw made non-finite
                    parents.append(ev)
                    in_nan, in_inf = in_nan or n, in_inf or i
                else:  # made by no op we saw: a constant (wrapped scalar, torch.tensor(inf), inf buffer)
                    lit_nan, lit_inf = lit_nan or n, lit_inf or i
        out = {"numel": 0, "nan": 0, "posinf": 0, "neginf": 0}
        for _, c in bad:
            for k, v in c.items():
                out[k] += v
        has_nan = out["nan"] > 0
        if not parents:
            if lit_nan or lit_inf:
                role = "conversion" if has_nan and not lit_nan else "literal"
            else:
                role = "origin"
        else:
            role = "conversion" if has_nan and not (in_nan or lit_nan) else "propagation"
        ev = Event(index=len(self.events), phase="backward" if self.phase == "backward" else "forward",
                   op=str(func), kind="nan" if has_nan else "inf", role=role,
                   parents=tuple(dict.fromkeys(parents)), out=out, fwd=fwd, node=node_name, node_seq=node_seq,
                   frame=user_frame(4) if self.phase == "backward" else None)
        if ev.frame is not None:
            ev.call = self.current_call
        if role in ("origin", "conversion"):  # only these can be culprits: worth the input statistics
            ev.inputs = [stats.tensor_stats(t) for t in inputs]
            ev.scalars = scalars
        self.events.append(ev)
        for t, c in bad:
            self.nonfinite[t] = (ev.index, c["nan"] > 0, c["posinf"] + c["neginf"] > 0)
            key = _storage_key(t)
            if key is not None:
                self.by_storage[key] = ev.index
        if has_nan and self.phase == "backward":
            self.nan_in_backward = True

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
            if node.name() == ACCUMULATE_GRAD:
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
                        self.anomaly = Anomaly(True, node.name(), node._sequence_nr(), i)
                        return
            finally:
                self.busy = False
        return hook


class _OpMode(TorchDispatchMode):
    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if rec.busy:
            return func(*args, **kwargs)
        seq = _get_sequence_nr()
        out = func(*args, **kwargs)
        rec.busy = True
        try:
            rec.on_op(func, args, kwargs, out, seq)
        except Exception as e:  # noqa: BLE001 - an observer must not crash what it observes
            rec.internal_errors.append(f"{func}: {type(e).__name__}: {e}")
        finally:
            rec.busy = False
        return out


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
        rec.current_call = n
        try:
            fix = rec.intercepts.get(n)
            if fix is not None:
                return fix(func, args, kwargs)
            return func(*args, **kwargs)
        finally:
            rec.current_call = 0


# The modes' own frames sit between the user's line and the op: look through them.
for _code in (_OpMode.__torch_dispatch__.__code__, _CallMode.__torch_function__.__code__):
    _frame_kind[_code] = _SKIP


def call_name(func: Any) -> str:
    """`torch.log`, `Tensor.sqrt`, `F.softmax`: how the user spelled the call."""
    if func is None:
        return ""
    if isinstance(func, torch._ops.OpOverload):
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


# ------------------------------------------------------------------ the step


def run(model: torch.nn.Module, forward: Callable[[], Any], loss: Callable[[Any], torch.Tensor], *,
        names: dict[int, str], prepare: Callable[[], None] | None = None, autocast: dict | None = None,
        site: Callable | None = None, intercepts: dict[int, Callable] | None = None,
        loss_module: str = "<loss>", backward_after_bad_loss: bool = True) -> Step:
    """Replay forward, loss and backward once, instrumented, and return what happened.

    Global state is restored on the way out, even when the replay raises: module
    hooks removed, modes popped, anomaly mode as it was. With
    backward_after_bad_loss=False a non-finite loss ends the replay there: the
    failure is then known and complete (fix verification needs no more).
    """
    rec = Recorder(names, site)
    rec.intercepts = intercepts or {}
    handles = rec.install_module_hooks() if site is None else []  # exported programs: the site knows
    node_handles: list = []
    model.zero_grad(set_to_none=True)
    loss_t = None
    backward_error = None
    try:
        with anomaly_off():  # it would raise mid-backward and hide the rest
            if prepare is not None:
                prepare()
            try:
                with _CallMode(rec), _OpMode(rec), autocast_from(autocast):
                    rec.phase = "forward"
                    output = forward()
                    rec.phase = "loss"
                    rec.module_stack[:] = [loss_module]
                    loss_t = loss(output)
                    rec.finish_forward()
            except NanReplayError:
                raise
            except Exception as e:  # noqa: BLE001 - user code
                raise AnalysisError(_replay_error("forward" if rec.phase == "forward" else "loss", e, rec)) from e
            rec.phase = "backward"
            loss_finite = stats.finite_fast(loss_t.detach())
            skipped = not loss_finite and not backward_after_bad_loss
            if not (loss_t.requires_grad and loss_t.grad_fn is not None):
                backward_error = "the loss does not require grad: no backward pass to replay"
            elif not skipped:
                node_handles = rec.watch_anomaly(loss_t.grad_fn)
                # With a non-finite loss the failure is the loss: its chain is all forward, and backward
                # events could not change the culprit. Backward then runs uninstrumented; only the
                # anomaly-mode emulation watches it (armed from the start: NaN may flow from the loss).
                instrument = loss_finite
                rec.nan_in_backward = not instrument
                try:
                    # the call mode numbers Python-level calls in backward too (custom Functions' backward),
                    # so a fix can be verified there; C++ backward formulas never reach it
                    if instrument:
                        with _CallMode(rec), _OpMode(rec):
                            _backward(loss_t)
                    else:
                        loss_t.backward()
                except Exception as e:  # noqa: BLE001
                    raise AnalysisError(_replay_error("backward", e, rec)) from e
    finally:
        for h in handles + node_handles:
            h.remove()
    grads = [stats.grad_stats(n, p) for n, p in model.named_parameters()]
    failure = _failure(rec, loss_t, model)
    anomaly = None if skipped else rec.anomaly or Anomaly(False)
    return Step(loss=float(loss_t.detach().double()) if loss_t is not None else None,
                events=rec.events, ops=rec.ops, op_by_seq=rec.op_by_seq, failure=failure, anomaly=anomaly,
                grads=grads, call_names=[call_name(f) for f in rec.call_funcs],
                internal_errors=rec.internal_errors, backward_error=backward_error,
                activations=rec.activations, grad_shapes=rec.grad_shapes)


def _backward(loss: torch.Tensor) -> None:
    """loss.backward() without going through a torch function: under the call mode, Tensor.backward
    would itself be a numbered call, and the mode is switched off inside a call it handles — so the
    Python code backward runs (custom Functions) would go unseen."""
    from torch.autograd.variable import Variable

    Variable._execution_engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                                            allow_unreachable=True, accumulate_grad=True)


def run_subject(subject, **kw) -> Step:
    """`run` for a rebuilt snapshot (a `rebuild.Subject`)."""
    return run(subject.model, subject.forward, subject.loss, names=subject.names, prepare=subject.prepare,
               autocast=subject.autocast, site=subject.site, **kw)


def autocast_from(setting: dict | None):
    """torch.autocast from a recorded setting, or nothing."""
    return torch.autocast(**setting) if setting else contextlib.nullcontext()


@contextlib.contextmanager
def anomaly_off():
    """Anomaly mode off for the duration (a replay must see the whole step); restored as it was, even on error."""
    was = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    torch.autograd.set_detect_anomaly(False)
    try:
        yield
    finally:
        torch.autograd.set_detect_anomaly(*was)


def _replay_error(stage: str, e: BaseException, rec: Recorder) -> str:
    where = ""
    if rec.ops:
        last = rec.ops[-1]
        where = f" (after {len(rec.ops)} ops; last in module {last.module or '<root>'!r}"
        fj = frame_json(last.frame)
        where += f", {fj['file']}:{fj['line']})" if fj else ")"
    return f"the {stage} pass raised {type(e).__name__}: {first_line(e)}{where}"


def _failure(rec: Recorder, loss: torch.Tensor | None, model: torch.nn.Module) -> Failure | None:
    if loss is None:
        return None
    n, i = stats.kinds(loss.detach())
    if n or i:
        hit = rec.nonfinite.get(loss)
        ev = hit[0] if hit is not None else _last_forward_event(rec)
        return Failure("loss", "loss", "nan" if n else "inf", ev)
    best: Failure | None = None
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        n, i = stats.kinds(p.grad)
        if not (n or i):
            continue
        hit = rec.nonfinite.get(p.grad)
        ev = hit[0] if hit is not None else rec.by_storage.get(_storage_key(p.grad))
        cand = Failure("gradient", name, "nan" if n else "inf", ev)
        if best is None or (ev is not None and (best.event is None or ev < best.event)):
            best = cand
    return best


def _last_forward_event(rec: Recorder) -> int | None:
    fwd = [e.index for e in rec.events if e.phase == "forward"]
    return fwd[-1] if fwd else None
