"""The forward of a step program up to its first patched node, run once for every candidate fix of one culprit.

Fix verification replays the step once per candidate (and once more per ε probe). Every one of those replays
computes the same forward up to the first call any candidate patches: the patches change nothing before it.
`Upstream` runs that part once, on its own copy of the step, with its graph kept; each candidate then runs only
the nodes from there (`run_patched(..., upstream=)`), its own backward, and on from the gradients that reached
the shared values through the shared graph (kept for the next candidate): the same nodes on the same values, in
the order one backward would have run them. The loss and every gradient are bit for bit those of a replay from
the first node.

Only where that holds by construction: a step program; no node from the first patched one on writes into a
tensor made before it or a leaf (`segments.writes_outside`: the shared values must stay as they were); the calls
before it numbered exactly as in the analyzed replay (checked: the count must land on the patched call).
"""

from __future__ import annotations

from typing import Any

import torch

from nanreplay import torch_internals as ti
from nanreplay.formats.segments import writes_outside
from nanreplay.replay.recorder import Recorder, _CallMode
from nanreplay.replay.run import anomaly_off


class Upstream:
    """The shared part: a copy of the step, the values live at node `start` (with their graph), and how many
    calls the replay had numbered there. Built by `build`; `release()` drops it (memory)."""

    def __init__(self, copy: Any, env: dict, start: int, calls: int, grad: bool):
        self.copy, self.env, self.start, self.calls, self.grad = copy, env, start, calls, grad
        self.cut: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, rec: Recorder) -> torch.Tensor:
        """One candidate's forward from the shared values, under the caller's call mode with `rec` numbering on from
        the shared count: the loss, as the subject computes it. The shared values that carry a graph enter it as
        leaves of their own (unseen by the numbering), so that its backward frees its own graph as it goes and
        stops at them; `backward` then carries their gradients through the shared graph, which it keeps."""
        rec.calls = self.calls
        env = dict(self.env)
        self.cut = []
        with ti.function_modes_off():
            for r, t in self.env.items():
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    env[r] = t.detach().requires_grad_()
                    self.cut.append((t, env[r]))
        return self.copy.loss(self.copy.model.suffix(self.start, env, self.grad))

    def backward(self) -> None:
        """After the candidate's own backward: the gradients that reached the shared values, on through the shared
        graph (kept for the next candidate). Every node of the candidate's part ran before any node of the shared
        part would have in one backward (all were made after it), so the gradients accumulate in the same order."""
        pairs = [(t, leaf.grad) for t, leaf in self.cut if leaf.grad is not None]
        self.cut = []
        if pairs:
            ti.run_backward_from([t for t, _g in pairs], [g for _t, g in pairs], retain_graph=True)

    def release(self) -> None:
        self.copy = self.env = None

    @property
    def alive(self) -> bool:
        return self.env is not None


def build(subject: Any, step: Any, first_call: int) -> Upstream | None:
    """The shared forward up to the node that makes call `first_call` (the first any candidate patches or
    compares at), or None where it cannot be shared (see the module)."""
    if not subject.program or step is None or first_call < 2:
        return None
    node = next((r.node for r in step.ops if r.call == first_call and r.node is not None), None)
    model = subject.model
    prog = getattr(model, "program", None)
    if node is None or prog is None or node == 0 or writes_outside(prog, node):
        return None
    copy = subject.converted()
    rec = Recorder(copy.names, copy.site)
    copy.model.zero_grad(set_to_none=True)
    with anomaly_off():
        if copy.prepare is not None:
            copy.prepare()
        with _CallMode(rec):
            env, left = copy.model.prefix(node, copy.inputs, copy.target)
    if rec.calls != first_call - 1:  # numbered otherwise than the analyzed replay: not the same replay
        return None
    return Upstream(copy, env, node, rec.calls, left)
