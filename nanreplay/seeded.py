"""The precision probe's question asked of the culprit's segment first: does the culprit op make NaN/Inf in the
wider dtype too? (docs/performance.md, "The precision probe")

A step program's instrumented replay keeps the values live at the start of each segment of its checkpoint plan
and the gradients that reached each segment's outputs (formats/boundaries.py: references, with their version
counters). Here the probe's copy, in the wider dtype, runs only the culprit's segment, seeded with those values
converted to that dtype: up to a forward culprit under no_grad; forward and backward from those gradients for a
backward culprit (whose row also needs the loss: the forward from the last boundary on, without a graph).

Seeded values are the step's as it ran, not as the wider dtype would have computed them upstream. So an answer
"it fails there too" counts only when it holds for seeded values moved by far more than their rounding (`move_of`
each value, zeros to ±float32's smallest normal, both ways): a log of a zero that the segment makes itself (a
ReLU's), a sqrt of a clearly negative value, a distance of a vector to itself. A zero or a near-edge value that
came in through the boundary (a softmax that underflowed upstream) moves, the answer changes, and the step is
replayed whole as before. "It is finite there" lets a forward culprit's probe skip its forward-alone pass (a
tripwire in the whole step falls back to the probe as it was if the op fails there after all); the whole step
still gives the row.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from nanreplay import stats
from nanreplay import torch_internals as ti
from nanreplay.formats.program import node_outputs
from nanreplay.formats.segments import first_leaf_write

MOVE = 2.0 ** -12  # each seeded value moved by this share of itself: ~2000 float32 roundings, both ways ...
HALF_ULPS = 16  # ... or by 16 roundings of its own dtype where that is coarser (bf16: 12.5%, fp16: 1.6%)


def move_of(dtype: torch.dtype) -> float:
    """How far a seeded value of this dtype is moved: far beyond what its upstream, in a wider dtype, could differ by."""
    return max(MOVE, HALF_ULPS * torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0
FAILS, FINITE = "fails", "finite"


def culprit_answer(subject: Any, variant: Any, culprit: Any, mode: Any = None) -> tuple[str, int, Any] | None:
    """(FAILS or FINITE, the node the runs started at, the loss from there where FAILS needs it) for the culprit
    of a step program whose instrumented replay kept its boundaries; None where this cannot answer (not such a
    step, nothing kept, a node before the segment writes into a weight or buffer, seeded runs that disagree, a
    run that raises)."""
    model = subject.model
    node = getattr(culprit, "node", None)
    if not subject.program or node is None or culprit.phase not in ("forward", "backward") \
            or not hasattr(model, "kept"):
        return None
    prog = model.program
    if len({p.dtype for p in model.parameters() if p.is_floating_point()}) > 1:
        return None  # weights the code cast to another dtype beside the step's: which seeds go where is not known
    want = culprit.op if culprit.phase == "forward" else culprit.fwd_op
    if not 0 <= node < len(prog.nodes) or prog.nodes[node].name != want:
        return None
    write = first_leaf_write(prog)  # no replay may start after a node that writes into a leaf
    try:
        with mode if mode is not None else contextlib.nullcontext():
            if culprit.phase == "forward":
                return _forward(model, variant, node, min(node, write))
            return _backward(model, variant, culprit, node, write)
    except Exception:  # noqa: BLE001 - no answer here: the whole step is replayed as before
        return None


def _forward(model, variant, node: int, limit: int) -> tuple[str, int, Any] | None:
    copy = variant.model
    start, seeded = 0, {}
    for s in reversed(model.kept_starts()):
        got = model.kept(s) if s <= limit else None
        if got is not None:
            start, seeded = s, got
            break
    made = _made_by(model.program, seeded)
    for sign in (1.0, -1.0):  # does it fail wherever the wider dtype's upstream values could be?
        moved = {r: _moved(_to(copy, t, made.get(r)), sign, t.dtype) for r, t in seeded.items()}
        with torch.no_grad():
            _env, out = copy.run_from(start, node + 1, moved, variant.inputs, variant.target, watch=node)
        if not _nonfinite(out):
            # finite where upstream might have handed over these values: the whole step decides (and its
            # forward-alone pass is skipped); failing with them moved one way but not the other: no answer
            return (FINITE, start, None) if sign > 0 else None
        if start == 0:  # nothing seeded: that run was the step's own forward up to the culprit
            break
    return FAILS, start, None


def _backward(model, variant, culprit, node: int, write: int) -> tuple[str, int, Any] | None:
    """A backward culprit: its forward op's segment, seeded, run forward and backward from the gradients that
    reached the segment's outputs in the instrumented replay (moved as the values are); where the culprit's
    backward op fails both ways, the loss comes from the rest of the forward, from the same seeds, without a
    graph."""
    copy = variant.model
    seg = next((s for s in (model.segment_at(s) for s in [0, *model.kept_starts()]) if s is not None
                and s.unit is not None and s.start <= min(node, write) and node < s.stop), None)
    if seg is None:
        return None
    seeded = model.kept(seg.start) if seg.start else {}
    grads = model.kept_grads(seg.start)
    if seeded is None or not grads or not all(stats.finite_fast(g) for g in grads.values()):
        return None
    made = _made_by(model.program, {**seeded, **grads})
    for sign in (1.0, -1.0):
        moved = {r: _moved(_to(copy, t, made.get(r)), sign, t.dtype) for r, t in seeded.items()}
        with torch.enable_grad():
            env, out = copy.run_from(seg.start, seg.stop, moved, variant.inputs, variant.target, watch=node)
        made_by_node = out if isinstance(out, torch.Tensor) else next(
            (t for t in out if isinstance(t, torch.Tensor)), None) if isinstance(out, (list, tuple)) else None
        fn = getattr(made_by_node, "grad_fn", None)
        pairs = [(r, env[r]) for r in grads if isinstance(env.get(r), torch.Tensor) and env[r].requires_grad]
        if fn is None or not pairs:
            return None
        hit = _Watch(ti.node_sequence_nr(fn), culprit.op)
        try:
            with hit:
                torch.autograd.backward([t for _r, t in pairs],
                                        [_moved(_to(copy, grads[r], made.get(r)), sign, grads[r].dtype) for r, _t in pairs])
        except _Hit:
            pass
        finally:
            copy.zero_grad(set_to_none=True)
        if not hit.fired:
            return (FINITE, seg.start, None) if sign > 0 else None
    # the loss: the forward from the last boundary kept on (its values as they ran: float32 values differ from a
    # float64 upstream's by their rounding, far below what a row shows), or from the start where they are half
    last = max((s for s in model.kept_starts() if seg.start <= s <= write and model.kept(s) is not None),
               default=seg.start)
    at = model.kept(last) if last else {}
    if any(t.is_floating_point() and t.element_size() < 4 for t in at.values()):
        last, at = 0, {}
    made = _made_by(model.program, at)
    with torch.no_grad():
        env, _out = copy.run_from(last, len(model.program.nodes), {r: _to(copy, t, made.get(r)) for r, t in
                                                                     at.items()}, variant.inputs, variant.target)
    loss = env.get(model.program.loss)
    if not isinstance(loss, torch.Tensor) or not stats.finite_fast(loss):
        return None  # a finite step's loss that is not finite here: the whole step says what that means
    return FAILS, seg.start, (loss, last)


class _Hit(BaseException):  # noqa: N818 - not an error: the culprit's backward op made NaN/Inf here too
    pass


class _Watch(ti.TorchDispatchMode):
    """Raises _Hit right after the culprit's backward op (`op`, run by the autograd node numbered `seq`) when
    its output is not finite, as the whole-step probe stops (verify._StopAt)."""

    def __init__(self, seq: int, op: str):
        super().__init__()
        self.seq, self.op, self.fired = seq, op, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        node = ti.current_autograd_node()
        if node is not None and str(func) == self.op and ti.node_sequence_nr(node) == self.seq and _nonfinite(out):
            self.fired = True
            raise _Hit
        return out


def _nonfinite(out) -> bool:
    outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)] \
        if isinstance(out, (list, tuple)) else []
    return not all(stats.finite_fast(t) for t in outs if t.is_floating_point())


def op_inputs(subject: Any, node: int | None, op: str) -> list[torch.Tensor] | None:
    """The tensor inputs of forward node `node` of the analyzed step (a backward culprit's forward op: the report
    shows them), from the last boundary kept before it: the same values the whole forward would give (the same
    computation from the same values), for a fraction of it. None where that cannot be (replay/probe.py then
    runs the forward from the start)."""
    model = subject.model
    if not subject.program or node is None or not hasattr(model, "kept") or not 0 <= node < len(model.program.nodes) \
            or model.program.nodes[node].name != op:
        return None
    limit = min(node, first_leaf_write(model.program))
    start = max((s for s in model.kept_starts() if s <= limit and model.kept(s) is not None), default=0)
    seeded = {r: t.clone() for r, t in (model.kept(start) or {}).items()}  # never the kept tensors themselves
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        got = model.inputs_of(start, node, seeded, subject.inputs, subject.target)
    except Exception:  # noqa: BLE001 - no answer here: the forward from the start gives it
        return None
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    if got is None:
        return None
    args, kwargs = got
    return [t for a in list(args) + list(kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
            if isinstance(t, torch.Tensor)]


def _made_by(prog, seeded: dict) -> dict[int, Any]:
    want, out = set(seeded), {}
    for n in prog.nodes:
        for r in node_outputs(n):
            if r in want and r not in out:
                out[r] = n
    return out


def _to(copy, t: torch.Tensor, producer) -> torch.Tensor:
    """A seeded value in the dtype the copy's own replay would give it there (its dtype policy: a low dtype that
    only autocast made goes where autocast's casts go, the step's dtype where the step's goes); never the kept
    tensor itself (a run may write into its inputs)."""
    if t.is_floating_point() and copy.policy is not None:
        all_map, cast_map = copy.policy
        d = t.dtype
        to = cast_map[d] if d in cast_map and (d not in all_map or getattr(producer, "cast", False)) \
            else all_map.get(d, d)
        return t.to(to, copy=True)
    return t.clone()


def _moved(t: torch.Tensor, sign: float, was: torch.dtype) -> torch.Tensor:
    """Each value moved by `move_of` its kept dtype (`was`), up or down at random (a fixed generator, not the global
    RNG), and zeros to ±float32's smallest normal (`sign`): what an upstream computed in another dtype might have
    handed over."""
    if not t.is_floating_point():
        return t
    g = torch.Generator(device=t.device).manual_seed(0)
    r = torch.randint(0, 2, t.shape, generator=g, device=t.device).to(t.dtype) * 2 - 1
    out = t * (1 + sign * move_of(was) * r)
    return torch.where(t == 0, torch.full_like(t, sign * torch.finfo(torch.float32).tiny), out)


def sentence(start: int, phase: str, loss_from: int | None = None) -> str:
    """The `derived` field of a precision row answered here (the step itself not replayed in that dtype)."""
    loss = (f"this dtype's forward from node {loss_from} on, seeded the same way" if loss_from else
            "this dtype's forward, without a graph")
    how = ("run forward and backward from the gradients that reached its outputs, makes NaN/Inf at the culprit op "
           f"(the loss: {loss})" if phase == "backward" else "makes NaN/Inf at the culprit op")
    return (f"not replayed as a whole step: the culprit's segment (from node {start}) in this dtype, seeded with the "
            f"values the instrumented replay had there, {how}; it does so with each seeded value moved by "
            f"{MOVE:.2g} of itself (or {HALF_ULPS} roundings of a half-precision value) either way (zeros to "
            f"±{torch.finfo(torch.float32).tiny:.2g}) too")
