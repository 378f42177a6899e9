"""Every private or semi-private torch API nanreplay leans on, behind one guarded accessor each.

torch changes its internals between releases. Nothing else in nanreplay touches
them directly: it calls the accessors here, each of which degrades to a stated,
safe answer when the API is missing or raises, and `probe()` says which ones work
on the installed torch (the report's environment section shows it).

What degrades when an accessor fails:

* `sequence_nr` / `node_sequence_nr`: backward events lose their link to the forward
  op (no `forward_op`, no forward source line for backward culprits).
* `current_autograd_node`: backward events lose their autograd node name.
* `run_backward`: backward runs through `Tensor.backward()`; Python code inside backward
  (custom `autograd.Function.backward`) is then not numbered, so fixes there cannot be verified.
* `op_is_view` / `op_mutated_args`: every op output is scanned (slower, same answer) /
  in-place ops are treated as pure (a NaN written in place may be linked less exactly).
* `saved_tensors_of`: autocast is not inferred from the graph at capture; pass `autocast=`.
* `foreach_norm`: the guard's gradient norm (and its check of the weights after each update) takes one
  kernel per parameter instead of one fused one.
* `foreach_copy`: NanGuard(keep_pre_step=True) copies the weights with one kernel per tensor.
* `default_foreach`: the implementation path an optimizer with `foreach=None` took is guessed from the
  device (foreach on CUDA, single-tensor elsewhere), as torch does today.
* `is_custom_function_node`: custom autograd.Functions are not detected at capture.
* `backward_hooks`: an unreproduced gradient failure does not name the step's backward hooks.
* `accumulated_variable`: a program that would cut a parameter's gradient path is not detected at capture.
* `fsdp_recompute_state`: a step of an FSDP2 model cannot be recorded (the sharded snapshot says why).
* `fsdp_traffic_unseen`: `nanreplay analyze DIR --nproc N` refuses FSDP2 snapshots (single-process analysis works).
* `dispatch_modes_off`: used only by the two above.
* `function_modes_off`: a step program's own bookkeeping (restoring buffers, checking arguments) is seen by
  the replay's call numbering; a fix's patch, keyed by call number, can then land on another call in a
  second replay of the same copy (the engine's landing check refuses it, and says so).
* `lazy_dynamo_off` (nanreplay's `TorchDispatchMode`): torch wraps each mode's handler itself again, and the
  first replay of a process imports torch._dynamo (~1.1 s) where nothing else has: slower, the same values.
* `decomposition`: the kernel differential (differential/reference.py) has no reference composition for the
  fused norms (`native_layer_norm`, `native_group_norm`, `native_batch_norm`): those rows say `skipped`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Public-but-underscored modules every dispatch-level tool uses; a torch without them cannot run nanreplay.
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary  # noqa: F401  (re-exported)

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket

_broken: dict[str, str] = {}  # accessor -> why it failed the first time (shown by probe())


def _note(name: str, e: BaseException) -> None:
    _broken.setdefault(name, f"{type(e).__name__}: {e}"[:200])


# ------------------------------------------------------------------ dispatch modes


def _dynamo_loaded() -> bool:  # (absent, or still importing: no frame callback can be set)
    m = sys.modules.get("torch._dynamo")
    return hasattr(m, "disable") and not getattr(getattr(m, "__spec__", None), "_initializing", False)


def _as_torch_wraps(owner: type, raw: Callable) -> Callable:  # `owner`'s handler from now on: torch's own wrap
    owner.__torch_dispatch__ = wrapped = torch._disable_dynamo(raw, recursive=True)
    return wrapped


def _dynamo_off_when_loaded(owner: type, raw: Callable) -> Callable:
    """`raw`, unwrapped until torch._dynamo is loaded (torch's `_disable_dynamo` wrap imports it, ~1.1 s, only to
    turn off a frame callback nothing can have set without it); then torch's wrap, swapped in at `__enter__` or
    at the first call after the import (the user compiled, built an optimizer)."""

    @functools.wraps(raw)
    def handler(self, func, types, args=(), kwargs=None):
        if _dynamo_loaded():
            return _as_torch_wraps(owner, raw)(self, func, types, args, kwargs)
        return raw(self, func, types, args, kwargs)

    handler._nanreplay_raw = raw
    return handler


class TorchDispatchMode(_TorchDispatchMode):
    """torch's TorchDispatchMode whose handler imports torch._dynamo only once something else has."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's wrap is replaced by `_dynamo_off_when_loaded` below

    def __init_subclass__(cls, **kwargs):
        raw = cls.__dict__.get("__torch_dispatch__")
        super().__init_subclass__(**kwargs)
        if raw is None or isinstance(raw, classmethod):
            return
        if cls.__dict__["__torch_dispatch__"] is raw:  # torch wrapped nothing: ours instead
            cls.__torch_dispatch__ = _dynamo_off_when_loaded(cls, raw)
        else:
            _broken.setdefault("lazy_dynamo_off", "torch wraps the handler itself: a replay imports torch._dynamo")

    def __enter__(self):
        if _dynamo_loaded():  # before any handler runs, where no compiled frame can be tracing it
            for klass in type(self).__mro__:
                raw = getattr(klass.__dict__.get("__torch_dispatch__"), "_nanreplay_raw", None)
                if raw is not None:
                    _as_torch_wraps(klass, raw)
        return super().__enter__()


# ------------------------------------------------------------------ autograd


try:
    from torch._C._autograd import _get_sequence_nr as _seq_nr
except ImportError as _e:  # pragma: no cover - depends on the torch build
    _seq_nr = None
    _broken["sequence_nr"] = f"ImportError: {_e}"


def sequence_nr() -> int:
    """The autograd sequence number the next node created will take (+1); -1 when unknown."""
    if _seq_nr is None:
        return -1
    try:
        return _seq_nr()
    except Exception as e:  # noqa: BLE001
        _note("sequence_nr", e)
        return -1


def current_autograd_node() -> Any | None:
    """The autograd node whose backward is running now (None outside backward, or when unknown)."""
    try:
        return torch._C._current_autograd_node()
    except Exception as e:  # noqa: BLE001
        _note("current_autograd_node", e)
        return None


def node_sequence_nr(node: Any) -> int | None:
    """An autograd node's sequence number, or None."""
    try:
        return node._sequence_nr()
    except Exception as e:  # noqa: BLE001
        _note("node_sequence_nr", e)
        return None


def node_name(node: Any) -> str | None:
    try:
        return node.name()
    except Exception as e:  # noqa: BLE001
        _note("node_name", e)
        return None


def run_backward(loss: torch.Tensor, retain_graph: bool = False) -> None:
    """`loss.backward()` without passing through a torch function (see replay.run for why)."""
    run_backward_from([loss], [torch.ones_like(loss)], retain_graph, _name="run_backward")


def run_backward_from(tensors: list, grads: list, retain_graph: bool = False, _name="run_backward_from") -> None:
    """Backward from several tensors with the given gradients, without passing through a torch function."""
    try:
        from torch.autograd.variable import Variable

        engine = Variable._execution_engine
    except Exception as e:  # noqa: BLE001
        _note(_name, e)
        torch.autograd.backward(tensors, grads, retain_graph=retain_graph)
        return
    engine.run_backward(tuple(tensors), tuple(grads), retain_graph, False, (), allow_unreachable=True,
                        accumulate_grad=True)


def autograd_nodes(root: Any, limit: int = 200_000):
    """Every node of the autograd graph behind `root` (a grad_fn), each once, at most `limit` of them."""
    seen, todo = set(), [root]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        try:
            todo.extend(n for n, _ in node.next_functions)
        except Exception as e:  # noqa: BLE001
            _note("autograd_nodes", e)


def is_custom_function_node(node: Any) -> bool:
    """Is this autograd node the backward of a user-defined `torch.autograd.Function`?

    Not the one torch puts around a module that has full backward hooks (`register_full_backward_hook`,
    `register_full_backward_pre_hook`, the global `register_module_full_backward_hook`): its forward is an
    identity (the ops a program records are the views it returns) and its backward only calls the hooks, which a
    replay does not run, like a tensor's `register_hook`."""
    try:
        if not isinstance(node, torch.autograd.function.BackwardCFunction):
            return False
        fwd = getattr(node, "_forward_cls", None)
        return fwd is None or fwd is not _module_hook_function()
    except Exception as e:  # noqa: BLE001
        _note("is_custom_function_node", e)
        return False


def in_module_hook_function(depth: int = 12) -> bool:
    """Is an op running inside that identity Function (autograd makes its outputs as views, under no_grad, called from
    `torch.utils.hooks.BackwardHook._apply_on_tensors`)? Those views are connected to the graph by the Function's
    node, so a program must replay them with grad on."""
    code = _module_hook_apply_code()
    if code is None:
        return False
    try:
        f = sys._getframe(1)
    except Exception as e:  # noqa: BLE001
        _note("is_custom_function_node", e)
        return False
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code is code:
            return True
        f = f.f_back
    return False


@functools.cache
def _module_hook_apply_code() -> Any:
    try:
        from torch.utils.hooks import BackwardHook

        return BackwardHook._apply_on_tensors.__code__
    except Exception as e:  # noqa: BLE001
        _note("is_custom_function_node", e)
        return None


@functools.cache
def _module_hook_function() -> type | None:
    """torch's identity Function for modules with full backward hooks (torch.nn.modules._functions)."""
    try:
        from torch.nn.modules._functions import BackwardHookFunction

        return BackwardHookFunction
    except Exception as e:  # noqa: BLE001
        _note("is_custom_function_node", e)
        return None


def backward_hooks(model: torch.nn.Module) -> list[str]:
    """Where the model runs Python hooks in backward that change what flows back (module backward hooks, a
    parameter's `register_hook`), as names; [] when none, or when unknown."""
    try:
        found = [f"module {n or '(the model)'!r}" for n, m in model.named_modules()
                 if m._backward_hooks or m._backward_pre_hooks]
        found += [f"parameter {n!r}" for n, p in model.named_parameters() if p._backward_hooks]
    except Exception as e:  # noqa: BLE001
        _note("backward_hooks", e)
        return []
    return found


def accumulated_variable(node: Any) -> torch.Tensor | None:
    """The leaf an `AccumulateGrad` node accumulates into; None for any other node (or when unknown)."""
    if type(node).__name__ != "AccumulateGrad":
        return None
    try:
        v = node.variable
    except Exception as e:  # noqa: BLE001
        _note("accumulated_variable", e)
        return None
    return v if isinstance(v, torch.Tensor) else None


def saved_tensors_of(node: Any) -> list[torch.Tensor]:
    """The tensors an autograd node saved for backward (its `_saved_*` attributes); [] when unknown."""
    out = []
    try:
        names = [a for a in dir(node) if a.startswith("_saved_")]
    except Exception as e:  # noqa: BLE001
        _note("saved_tensors_of", e)
        return out
    for attr in names:
        try:
            v = getattr(node, attr)
        except Exception:  # noqa: BLE001,S112 - a freed buffer raises; skip it
            continue
        if isinstance(v, torch.Tensor):
            out.append(v)
    return out


# ------------------------------------------------------------------ ops


@functools.cache
def op_is_view(func: Any) -> bool:
    try:
        return bool(getattr(func, "is_view", False))
    except Exception as e:  # noqa: BLE001
        _note("op_is_view", e)
        return False


@functools.cache
def op_mutated_args(func: Any) -> tuple[frozenset, frozenset]:
    """(positions, keyword names) of the arguments an aten op writes to, from its schema."""
    pos, names = set(), set()
    try:
        schema = getattr(func, "_schema", None)
        for i, a in enumerate(schema.arguments if schema is not None else ()):
            if a.alias_info is not None and a.alias_info.is_write:
                pos.add(i)
                names.add(a.name)
    except Exception as e:  # noqa: BLE001
        _note("op_mutated_args", e)
    return frozenset(pos), frozenset(names)


def op_schema(func: Any) -> Any | None:
    """The op's `torch.FunctionSchema` (argument names and types), or None."""
    try:
        return func._schema
    except Exception as e:  # noqa: BLE001
        _note("op_schema", e)
        return None


def op_tags(func: Any) -> tuple:
    try:
        return tuple(func.tags)
    except Exception as e:  # noqa: BLE001
        _note("op_tags", e)
        return ()


def is_random_op(func: Any) -> bool:
    """Does the op draw random numbers (torch's `nondeterministic_seeded` tag)?"""
    return torch.Tag.nondeterministic_seeded in op_tags(func)


def real_values(t: torch.Tensor) -> torch.Tensor:
    """The entries of `t` as a dense real tensor with the same 2-norm and the same non-finite entries: a sparse
    tensor's values (a COO one coalesced first: its duplicates add), a complex one's real and imaginary parts
    (`view_as_real`). A dense real tensor is returned as it is. (A sparse embedding's gradient and a complex
    parameter's are both what real training hands the guard; `isfinite` and the norms do not take them.)"""
    if t.layout is not torch.strided:
        t = t.coalesce().values() if t.layout is torch.sparse_coo else t.values()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The 2-norm of each tensor, computed in `dtype` (one fused kernel where torch has `_foreach_norm`);
    sparse and complex tensors count their entries' real values (`real_values`), and float64 ones are normed in
    float64 (a float32 norm would narrow them: torch refuses). Those cases are found by the fused kernel refusing
    them, so that the common one (dense float32) pays for no extra pass over the list."""
    try:
        if dtype == torch.float32 and all(t.dtype == torch.float32 for t in tensors):
            return list(torch._foreach_norm(tensors))
        return list(torch._foreach_norm(tensors, 2, dtype=dtype))
    except Exception as e:  # noqa: BLE001
        if any(t.layout is not torch.strided or t.is_complex() or t.dtype == torch.float64 for t in tensors):
            return _value_norms(tensors, dtype)
        _note("foreach_norm", e)
        return [torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]


def _value_norms(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    tensors = [real_values(t) for t in tensors]
    if any(t.dtype == torch.float64 for t in tensors):
        dtype = torch.float64
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=dtype))
    except Exception:  # noqa: BLE001
        return [torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]


def foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i, as one fused kernel where torch has `_foreach_copy_`."""
    try:
        torch._foreach_copy_(dst, src)
        return
    except Exception as e:  # noqa: BLE001
        _note("foreach_copy", e)
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


def default_foreach(params: list[torch.Tensor]) -> bool:
    """Whether torch.optim takes its foreach path for these parameters when `foreach=None` (and not fused)."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        return bool(_default_to_fused_or_foreach(params, False, use_fused=False)[1])
    except Exception as e:  # noqa: BLE001
        _note("default_foreach", e)
        return bool(params) and all(p.device.type == "cuda" for p in params)


def function_modes_off() -> contextlib.AbstractContextManager:
    """No TorchFunctionMode sees the torch calls made inside (a step program's bookkeeping between its ops, so
    that the replay numbers the same calls every time, whatever replay ran before); dispatch modes still do."""
    try:
        return torch._C.DisableTorchFunction()
    except Exception as e:  # noqa: BLE001 - a torch without it
        _note("function_modes_off", e)
        return contextlib.nullcontext()


# ------------------------------------------------------------------ FSDP2 (sharded snapshots)


@contextlib.contextmanager
def dispatch_modes_off() -> Iterator[None]:
    """No TorchDispatchMode sees the ops run inside (they are not the step's: FSDP's own parameter traffic)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


class FsdpInternalsError(RuntimeError):
    """This torch's FSDP2 internals are not what nanreplay knows; the message says which."""


@contextlib.contextmanager
def fsdp_recompute_state(modules: list[torch.nn.Module]) -> Iterator[None]:
    """FSDP2's forward hooks behave as during activation-checkpoint recomputation (its PRE_BACKWARD state):
    the pre-forward gathers only parameters not gathered yet and the post-forward neither reshards nor
    registers backward hooks. Recording a step of an FSDP2 model runs its forward once more this way, with
    nanreplay gathering and freeing each unit's parameters itself; the states are restored on the way out."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        states = {id(s): s for s in (m._get_fsdp_state() for m in modules)}
        saved = [(s, s._training_state) for s in states.values()]
    except Exception as e:  # noqa: BLE001
        _note("fsdp_recompute_state", e)
        raise FsdpInternalsError(f"this torch's FSDP2 state is not what nanreplay knows ({type(e).__name__}: {e})") \
            from None
    try:
        for s, _ in saved:
            s._training_state = TrainingState.PRE_BACKWARD
        yield
    finally:
        for s, state in saved:
            s._training_state = state


_FSDP_GROUP_METHODS = ("unshard", "wait_for_unshard", "reshard", "pre_backward", "post_backward", "finalize_backward")


def current_dispatch_modes() -> list:
    """The TorchDispatchModes active now, outermost first ([] when unknown)."""
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        return list(_get_current_dispatch_mode_stack())
    except Exception as e:  # noqa: BLE001
        _note("current_dispatch_modes", e)
        return []


def current_function_modes() -> list:
    """The TorchFunctionModes active now, outermost first ([] when unknown)."""
    try:
        from torch.overrides import _get_current_function_mode_stack

        return list(_get_current_function_mode_stack())
    except Exception as e:  # noqa: BLE001
        _note("current_function_modes", e)
        return []


@contextlib.contextmanager
def fsdp_traffic_unseen(on_reduce: Callable[[Any, Callable[[], Any], list], Any] | None = None) -> Iterator[None]:
    """FSDP2's parameter groups gather, free and reduce with dispatch modes off, so an instrumented replay sees
    only the step's own ops. `on_reduce(group, run, modes)` wraps each group's post-backward (the gradient
    reduce-scatter), also with the modes off: it calls `run()` and may look at the gradients before and after
    (`fsdp_group_grads`); `modes` are the dispatch modes that were active (the replay's, to ask about tensors)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        originals = {n: FSDPParamGroup.__dict__[n] for n in _FSDP_GROUP_METHODS}
    except Exception as e:  # noqa: BLE001
        _note("fsdp_traffic_unseen", e)
        raise FsdpInternalsError(f"this torch's FSDP2 parameter groups are not what nanreplay knows "
                                 f"({type(e).__name__}: {e})") from None

    def unseen(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(self, *args, **kwargs):
            modes = current_dispatch_modes() if name == "post_backward" and on_reduce is not None else None
            with dispatch_modes_off():
                if modes is not None:
                    return on_reduce(self, lambda: fn(self, *args, **kwargs), modes)
                return fn(self, *args, **kwargs)
        return wrapped

    try:
        for n, fn in originals.items():
            setattr(FSDPParamGroup, n, unseen(n, fn))
        yield
    finally:
        for n, fn in originals.items():
            setattr(FSDPParamGroup, n, fn)


def fsdp_group_grads(group: Any, *, reduced: bool) -> list[tuple[str, torch.Tensor | None]]:
    """(parameter name, gradient) of an FSDP2 parameter group: each rank's own full gradient before the
    reduce-scatter (reduced=False), this rank's shard of the reduced one after it (reduced=True)."""
    out = []
    try:
        for fp in group.fsdp_params:
            if reduced:
                g = fp.sharded_param.grad
                g = g.to_local() if g is not None and hasattr(g, "to_local") else g
            else:
                g = getattr(fp, "unsharded_accumulated_grad", None)
                if g is None and hasattr(fp, "_unsharded_param"):
                    g = fp.unsharded_param.grad
            out.append((fp._param_fqn, g))
    except Exception as e:  # noqa: BLE001
        _note("fsdp_group_grads", e)
    return out


def fsdp_group_name(group: Any) -> str | None:
    """The module an FSDP2 parameter group belongs to ("" for the root), or None."""
    try:
        name = group._module_fqn
        return name.split(",")[0].strip() if isinstance(name, str) else None
    except Exception as e:  # noqa: BLE001
        _note("fsdp_group_name", e)
        return None


# ------------------------------------------------------------------ probe


# ------------------------------------------------------------------ decompositions


def decomposition(op: Any) -> Callable | None:
    """torch's own decomposition of an aten op into smaller ops (`torch._decomp`), or None: the reference
    composition a fused kernel is compared with (differential/reference.py)."""
    try:
        from torch._decomp import decomposition_table

        return decomposition_table.get(op)
    except Exception as e:  # noqa: BLE001
        _note("decomposition", e)
        return None


def probe() -> dict[str, str]:
    """Which accessors work on the installed torch: name -> "ok" or why not."""
    checks: dict[str, Callable[[], Any]] = {
        "sequence_nr": lambda: _seq_nr is not None and sequence_nr() >= 0,
        "current_autograd_node": lambda: current_autograd_node() is None,  # None outside backward
        "op_is_view": lambda: op_is_view(torch.ops.aten.view.default),
        "op_mutated_args": lambda: 0 in op_mutated_args(torch.ops.aten.add_.Tensor)[0],
        "op_schema": lambda: op_schema(torch.ops.aten.add.Tensor) is not None,
        "is_random_op": lambda: is_random_op(torch.ops.aten.bernoulli.default),
        "foreach_norm": lambda: float(foreach_norm([torch.ones(4)], torch.float64)[0]) == 2.0,
        "function_modes_off": lambda: not isinstance(function_modes_off(), contextlib.nullcontext),
        "lazy_dynamo_off": lambda: "lazy_dynamo_off" not in _broken,
    }

    def node_checks() -> bool:
        x = torch.ones(2, requires_grad=True)
        node = (x * 2).sum().grad_fn
        return node_sequence_nr(node) is not None and node_name(node) == "SumBackward0" \
            and isinstance(saved_tensors_of(node.next_functions[0][0]), list)

    checks["autograd_nodes"] = node_checks
    out = {}
    for name, check in checks.items():
        try:
            ok = bool(check())
        except Exception as e:  # noqa: BLE001
            ok = False
            _note(name, e)
        out[name] = "ok" if ok and name not in _broken else _broken.get(name, "unexpected answer")
    for name, why in _broken.items():
        out.setdefault(name, why)
    return out
