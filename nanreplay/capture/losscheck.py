"""The first step's check that the guard's loss is the loss the loop checks, and the model call as the loop made it.

A guard records a failing step by running it again: `loss_fn(model(*inputs), target)`, or `step_fn(model,
batch)`. If that is not what the loop computes, the guard would find out only at the failure (nanoGPT's
`(logits, loss)` given to `F.cross_entropy`: an AttributeError, no step program, a snapshot that needs the
training code). So, once, on the first `loss_ok()`:

* `CallWatch` — a forward hook on the model — has kept the call the loop made (its arguments, by reference:
  the batch the loop holds anyway) and, on this first step only, the output;
* the configured loss is computed on that output (one extra loss computation, under no_grad) and compared
  with the loss the loop gave `loss_ok()` (a whole-number ratio is gradient accumulation's `/ N`);
* where it raises or disagrees, the loss the loop checked is looked for among the model's outputs, by
  identity, then by value. Found: the guard warns once with the fix ("pass loss_fn=None") and records
  every failing step through that output. Not found: it warns once that snapshots record `loss_fn`'s loss.

With `step_fn` the step is run once more from the state `begin()` saved (`snapshot.from_begin_state`), and
the same comparison made. Every failing step is recorded with the arguments the loop actually passed to the
model, where they are not the inputs `begin()` was given (`begin(x, y)` and `model(x, y)`).
This module imports only torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nanreplay.capture import owned, snapshot
from nanreplay.errors import first_line
from nanreplay.replay.subject import compute_loss, model_loss

_RTOL = 1e-3
_MAX_ELEMENTS = 16  # tensors of a tuple / dict output tried as the one the loop gave loss_fn
log = logging.getLogger("nanreplay")


class CallWatch:
    """A forward hook on the guard's model: the first call after each begin(), and the first step's output."""

    def __init__(self, guard: Any):
        self._guard = weakref.ref(guard)
        self.want_output = True
        self.output: Any = None
        self.paused = False  # while the guard runs the model itself (recording, the check)
        self.handle = guard.model.register_forward_hook(self._hook, with_kwargs=True)
        self._finalizer = weakref.finalize(guard, self.handle.remove)

    def close(self) -> None:
        self._finalizer()

    @contextlib.contextmanager
    def looking_away(self) -> Iterator[None]:
        """While the guard runs the model itself (recording, the check): not the loop's call."""
        was, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = was

    def _hook(self, module, args, kwargs, output) -> None:
        guard = self._guard()
        if guard is None or self.paused or not guard._states or guard._states[-1].call is not None:
            return  # the first call after begin() is the step's (a later one may be a metric on other data)
        guard._states[-1].call = (tuple(args), dict(kwargs))
        if self.want_output:
            self.output = output


def first_step(guard: Any, loss: torch.Tensor, value: float) -> None:
    """Once, on the first loss_ok(): is the loss the guard's recording computes the loss the loop checked?
    Warns once where it is not; records through the model's own output where that is the loop's loss."""
    guard._check_pending = False
    calls = guard._calls
    output = calls.output if calls is not None else None
    if calls is not None:
        calls.want_output, calls.output = False, None
    if not guard._states or not guard.export or (guard.step_fn is not None and guard._step_is_loops):
        return  # (a trainer's own step is the loop's loss by construction: running it again, with whatever it
        # does besides the loss — metrics, logging, counters — would be the one thing a healthy run saw)
    st = guard._states[-1]
    try:
        if guard.step_fn is not None:
            def rerun():
                with snapshot.from_begin_state(guard.model, st, guard._autocast or None):
                    return guard.step_fn(guard.model, snapshot.rerun_copy(st).batch["batch"])
            msg = check_step_fn(rerun, guard.step_fn, value)
        elif output is not None:
            with calls.looking_away(), snapshot.autocast_context(guard._autocast or None):  # as the loop's loss ran
                picked, msg = check_loss_fn(output, st.batch.get("target"), guard.loss_fn, loss, value)
            if picked is not None:
                guard._record_loss, guard._loss_note = picked, msg
        else:
            return
    except Exception as e:  # noqa: BLE001 - a check must never break training
        log.debug("nanreplay: could not check the loss on the first step: %s", e)
        return
    if msg:
        guard._warn_once("loss-check", msg)


def call_inputs(call: tuple[tuple, dict] | None) -> Any:
    """The call's arguments as the `inputs` `call_model` takes (a tensor, a tuple, a dict); None: not expressible."""
    if call is None:
        return None
    args, kwargs = call
    if args and kwargs:
        return None
    if kwargs:
        return dict(kwargs)
    if len(args) == 1 and isinstance(args[0], torch.Tensor):
        return args[0]
    return tuple(args)


def same_inputs(a: Any, b: Any) -> bool:
    """The same call: the same structure holding the very same tensors (and equal plain values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_inputs(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_inputs(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot even compare are not the same call
        return False


def find_loss(output: Any, loss: torch.Tensor, value: float) -> tuple[list, torch.Tensor] | None:
    """(path, tensor) of the scalar among the model's outputs that is the loss the loop checked: by identity,
    else the one whose value equals it (or N times it)."""
    scalars = list(_scalars(output, []))
    for path, t in scalars:
        if t is loss:
            return path, t
    if not math.isfinite(value):
        return None
    values = [(p, t, float(t.detach().float())) for p, t in scalars]
    hits = [(p, t) for p, t, v in values if _close(v, value)] or [(p, t) for p, t, v in values if agrees(v, value)]
    return hits[0] if hits else None  # (agrees: the loop checked `loss / gradient_accumulation_steps`)


def _scalars(x: Any, path: list):
    for p, t in _tensors(x, path):
        if t.numel() == 1 and t.is_floating_point():
            yield p, t


def _tensors(x: Any, path: list, depth: int = 0):
    if depth > 8:
        return
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, dict) or (hasattr(x, "keys") and hasattr(x, "__getitem__")):
        for k in list(x.keys()):
            if isinstance(k, (str, int)):
                yield from _tensors(x[k], path + [k], depth + 1)
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from _tensors(v, path + [i], depth + 1)


def pick(path: list) -> Callable[[Any, Any], torch.Tensor]:
    """A loss that is the model's own output at `path` (the target is not used)."""
    def picked(output: Any, target: Any = None) -> torch.Tensor:
        for p in path:
            output = output[p]
        return output if output.dim() == 0 else output.reshape(())
    picked.path = list(path)  # type: ignore[attr-defined]
    return picked


def element(path: list, loss_fn: Callable) -> Callable[[Any, Any], torch.Tensor]:
    """A loss that is `loss_fn` on the model's output at `path` (minGPT's `logits, _ = model(x)`)."""
    def picked(output: Any, target: Any = None) -> torch.Tensor:
        for p in path:
            output = output[p]
        return compute_loss(output, target, loss_fn)
    picked.path, picked.loss_fn = list(path), loss_fn  # type: ignore[attr-defined]
    return picked


def used_element(output: Any, target: Any, loss_fn: Callable, loss: torch.Tensor, value: float,
                 rtol: float = _RTOL) -> Callable | None:
    """`loss_fn` on the one tensor of a tuple / dict / ModelOutput the loop gave it, where that is the loss the
    loop checked: the tensors the loss's autograd graph reaches first (identity), then the other floating ones in
    order; the first whose loss agrees with the checked value. None: no element does."""
    if isinstance(output, torch.Tensor):
        return None
    found = [(p, t) for p, t in _tensors(output, []) if t.is_floating_point() or t.is_complex()]
    reached = _graph_nodes(loss)
    found.sort(key=lambda pt: pt[1].grad_fn is None or id(pt[1].grad_fn) not in reached)  # stable: used first
    for path, t in found[:_MAX_ELEMENTS]:
        try:
            with torch.no_grad():
                got = float(compute_loss(owned.clone_tensors(t), owned.clone_tensors(target), loss_fn).detach().float())
        except Exception:  # noqa: BLE001, S112 - not the element the loop used
            continue
        if agrees(got, value, rtol):
            return element(path, loss_fn)
    return None


def _graph_nodes(loss: torch.Tensor, limit: int = 20000) -> set[int]:
    """ids of the autograd nodes the loss was computed through (a bounded walk)."""
    seen: set[int] = set()
    todo = [loss.grad_fn] if isinstance(loss, torch.Tensor) and loss.grad_fn is not None else []
    keep = []  # the nodes themselves, so that no id is reused during the walk
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
    return seen


def describe_output(x: Any, depth: int = 0) -> str:
    """`(logits, loss)`-style words for the model's output: `(tensor[4, 16, 64], scalar)`."""
    if isinstance(x, torch.Tensor):
        return "scalar" if x.numel() == 1 else f"tensor{list(x.shape)}"
    if depth > 1:
        return type(x).__name__
    if isinstance(x, (tuple, list)):
        inner = ", ".join(describe_output(v, depth + 1) for v in list(x)[:6])
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    if isinstance(x, dict) or hasattr(x, "keys"):
        return f"{type(x).__name__} with keys {', '.join(map(str, list(x.keys())[:6]))}"
    return type(x).__name__


def _close(a: float, b: float, rtol: float = _RTOL) -> bool:
    if math.isnan(a) and math.isnan(b):
        return True
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b)) + 1e-6


def agrees(mine: float, checked: float, rtol: float = _RTOL) -> bool:
    """The configured loss gives the loss the loop checked (or N times it: accumulation's division)."""
    if _close(mine, checked, rtol):
        return True
    if math.isfinite(mine) and math.isfinite(checked) and checked != 0 and mine != 0:
        ratio = mine / checked
        n = round(ratio)
        return 2 <= n <= 4096 and abs(ratio - n) <= rtol * n
    return False


def _name(fn: Callable | None) -> str:
    if fn is None:
        return "None"
    fn = getattr(fn, "func", fn)
    mod = getattr(fn, "__module__", "") or ""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return f"F.{name}" if mod.startswith("torch.nn.functional") else name


def check_loss_fn(output: Any, target: Any, loss_fn: Callable | None, loss: torch.Tensor, value: float):
    """(a recording loss to use instead, or None; the warning to give, or None) for the first step."""
    rtol = _RTOL if not any(t.dtype in (torch.float16, torch.bfloat16) for _, t in _tensors(output, [])) else 3e-2
    try:
        with torch.no_grad():  # (on copies: a loss that writes its target in place must not write the loop's)
            mine = compute_loss(owned.clone_tensors(output), owned.clone_tensors(target), loss_fn)
        got = float(mine.detach().float())
        if agrees(got, value, rtol):
            return None, None
        why = f"gives {got:.6g}, not the {value:.6g} the loop checked"
    except Exception as e:  # noqa: BLE001 - exactly what the check is for
        why = f"raises {type(e).__name__}: {first_line(e, 160)}"
    if loss_fn is not None:
        used = used_element(output, target, loss_fn, loss, value, rtol)
        if used is not None:
            return used, None
    shown = describe_output(output)
    what = (f"loss_fn={_name(loss_fn)} does not fit the model's output {shown}: it {why}" if loss_fn is not None
            else f"the model's own loss (loss_fn=None) is not the loss the loop checks: in its output {shown} it {why}")
    found = find_loss(output, loss, value)
    if found is not None:
        path, tensor = found
        where = "".join(f"[{p!r}]" for p in path)
        own = model_loss(output)
        fix = "pass loss_fn=None" if own is not None and own is tensor \
            else f"pass step_fn=lambda model, batch: model(...){where}, and begin(batch)"
        return pick(path), (f"{what}. The loss your loop checks is the model's own, output{where}: {fix}. Until then, "
                            f"this run's snapshots record the step through output{where}.")
    return None, (f"{what}, and the loss the loop checks is none of the model's outputs: this run's snapshots record "
                  "loss_fn's loss, not the loop's. Give the guard the loss the loop computes: "
                  "step_fn=fn(model, batch) -> loss, and begin(batch)")


def check_step_fn(rerun: Callable[[], torch.Tensor], step_fn: Callable, value: float) -> str | None:
    """The warning to give when step_fn, run once more from the step's begin() state, is not the loop's loss."""
    try:
        got = rerun()
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            why = f"returns {describe_output(got)}, not a scalar loss"
        else:
            got_v = float(got.detach().float())
            if agrees(got_v, value):
                return None
            why = f"gives {got_v:.6g}, not the {value:.6g} the loop checked"
    except Exception as e:  # noqa: BLE001 - exactly what the check is for
        why = f"raises {type(e).__name__}: {first_line(e, 160)}"
    return (f"step_fn={_name(step_fn)}(model, batch) {why}: snapshots of this run record step_fn's loss, not the "
            "loop's; make step_fn compute the loss the loop gives loss_ok(), from the batch given to begin()")
