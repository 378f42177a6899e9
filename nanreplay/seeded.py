"""The precision probe's first question, asked of one segment: does the forward culprit op make NaN/Inf in the
wider dtype too? (docs/performance.md, "The precision probe")

A step program's instrumented replay keeps the values live at the start of each segment of its checkpoint plan
(`StepModule.keep_boundaries`: references, with their version counters). Here the probe's copy, in the wider
dtype, runs only from the start of the culprit's segment to the culprit op, seeded with those values converted
to that dtype, under no_grad: a fraction of a forward instead of the step's forward up to the culprit.

Seeded values are the step's as it ran, not as the wider dtype would have computed them upstream. So an answer
"it fails there too" counts only when it holds for seeded values moved by far more than their rounding
(`MOVE` of each value, zeros to ±float32's smallest normal, both ways): a log of a zero that the segment makes
itself (a ReLU's), a sqrt of a clearly negative value. A zero or a near-edge value that came in through the
boundary (a softmax that underflowed upstream) moves, the answer changes, and the step is replayed whole as
before. "It is finite there" only lets the probe skip its forward-alone pass: the whole step still gives the row.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from nanreplay import stats
from nanreplay.formats.program import node_outputs
from nanreplay.formats.segments import first_leaf_write

MOVE = 2.0 ** -12  # each seeded value moved by this share of itself: ~2000 float32 roundings, both ways
FAILS, FINITE = "fails", "finite"


def forward_culprit(subject: Any, variant: Any, culprit: Any, mode: Any = None) -> tuple[str, int] | None:
    """(FAILS or FINITE, the node the runs started at) for a forward culprit of a step program whose instrumented
    replay kept its boundaries; None where this cannot answer (not such a step, nothing kept, a node before
    the segment writes into a weight or buffer, seeded runs that disagree, a run that raises)."""
    model, copy = subject.model, variant.model
    node = getattr(culprit, "node", None)
    if not subject.program or node is None or culprit.phase != "forward" or not hasattr(model, "kept"):
        return None
    prog = model.program
    if not 0 <= node < len(prog.nodes) or prog.nodes[node].name != culprit.op:
        return None
    limit = min(node, first_leaf_write(prog))
    start, seeded = 0, {}
    for s in sorted(model.__dict__.get("_kept", {}), reverse=True):
        got = model.kept(s) if s <= limit else None
        if got is not None:
            start, seeded = s, got
            break
    made = _made_by(prog, seeded)
    try:
        with mode if mode is not None else contextlib.nullcontext():
            for sign in (1.0, -1.0):  # does it fail wherever the wider dtype's upstream values could be?
                moved = {r: _moved(_to(copy, t, made.get(r)), sign) for r, t in seeded.items()}
                if not _fails(copy, variant, start, node, moved):
                    # finite where upstream might have handed over these values: the whole step decides (and its
                    # forward-alone pass is skipped); failing with them moved one way but not the other: no answer
                    return (FINITE, start) if sign > 0 else None
                if start == 0:  # nothing seeded: that run was the step's own forward up to the culprit
                    break
    except Exception:  # noqa: BLE001 - no answer here: the whole step is replayed as before
        return None
    return FAILS, start


def _fails(copy, variant, start: int, node: int, seeded: dict) -> bool:
    with torch.no_grad():
        out = copy.run_from(start, node + 1, seeded, variant.inputs, variant.target)
    outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)] \
        if isinstance(out, (list, tuple)) else []
    return not all(stats.finite_fast(t) for t in outs if t.is_floating_point())


def _made_by(prog, seeded: dict) -> dict[int, Any]:
    want, out = set(seeded), {}
    for n in prog.nodes:
        for r in node_outputs(n):
            if r in want and r not in out:
                out[r] = n
    return out


def _to(copy, t: torch.Tensor, producer) -> torch.Tensor:
    """A seeded value in the dtype the copy's own replay would give it there (its dtype policy, as for the node
    that made it); never the kept tensor itself (a run may write into its inputs)."""
    if t.is_floating_point() and producer is not None and copy.policy is not None:
        return t.to(copy._dtype(t.dtype, producer), copy=True)
    return t.clone()


def _moved(t: torch.Tensor, sign: float) -> torch.Tensor:
    """Each value moved by MOVE of itself, up or down at random (a fixed generator, not the global RNG), and zeros
    to ±float32's smallest normal (`sign`): what an upstream computed in another dtype might have handed over."""
    if not t.is_floating_point():
        return t
    g = torch.Generator(device=t.device).manual_seed(0)
    r = torch.randint(0, 2, t.shape, generator=g, device=t.device).to(t.dtype) * 2 - 1
    out = t * (1 + sign * MOVE * r)
    return torch.where(t == 0, torch.full_like(t, sign * torch.finfo(torch.float32).tiny), out)


def sentence(start: int) -> str:
    """The `derived` field of a precision row answered here (the step itself not replayed in that dtype)."""
    return (f"not replayed as a whole step: the culprit's segment (from node {start}) in this dtype, seeded with the "
            "values the instrumented replay had there, makes NaN/Inf at the culprit op, and so it does with each "
            f"of those values moved by {MOVE:.2g} of itself either way (zeros to ±{torch.finfo(torch.float32).tiny:.2g})")
