"""A step program's replay drops each intermediate after its last reader, as eager Python does.

Without it a replay holds every activation of the step at once (about 1.4x the step's memory on the
end-to-end benchmark); with it, the same loss and gradients from less memory.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay.capture.program import record_step
from nanreplay.formats.program import Ref, decode, to_json
from nanreplay.formats.stepmodel import StepModule


class Residual(nn.Module):
    """In-place activations, a residual read long after it was made, and a value computed and never used."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = F.relu(self.a(x), inplace=True)
        _unused = h * 3
        y = self.b(h)
        y.add_(x)  # the input, read again at the end
        return y


def _reads(node) -> set[int]:
    out: set[int] = set()

    def walk(v):
        if isinstance(v, Ref):
            out.add(int(v))
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(list(node.args) + list(node.kwargs.values()))
    return out


def _program():
    torch.manual_seed(0)
    m, x, y = Residual(), torch.randn(4, 8), torch.randn(4, 8)
    rec = record_step(lambda: m(x), lambda out: F.mse_loss(out, y), model=m, batch={"inputs": x, "target": y})
    return m, x, y, rec, decode(to_json(rec.program))


def test_nothing_is_dropped_before_its_last_reader_and_the_loss_never():
    *_, prog = _program()
    dead = prog.dead_after()
    assert any(dead), "the program drops nothing: the replay would hold every intermediate"
    for i, refs in enumerate(dead):
        assert prog.loss not in refs
        for r in refs:
            assert not any(r in _reads(n) for n in prog.nodes[i + 1:]), (i, r)
    dropped = {r for refs in dead for r in refs}
    read = {r for n in prog.nodes for r in _reads(n)}
    assert read - {prog.loss} <= dropped | {lf.ref for lf in prog.leaves}  # every intermediate goes, once read


def test_the_replay_gives_the_steps_loss_and_gradients():
    m, x, y, rec, prog = _program()
    loss = F.mse_loss(m(x), y)
    loss.backward()
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    step = StepModule(prog, state, [n for n, _ in m.named_parameters()], {}, rec.constants)
    replayed = step(x, y)
    replayed.backward()
    assert torch.equal(replayed.detach(), loss.detach())
    for name, p in m.named_parameters():
        assert torch.equal(step.get_parameter(name).grad, p.grad), name


def test_a_replay_under_no_grad_builds_no_graph_but_keeps_the_steps_own_no_grad_parts():
    """Forward-only passes (the precision probe of a loss failure, plausibility) run the program under
    no_grad: the nodes the step ran with grad on must not switch it back on and build a graph (it held a
    whole float64 graph at once: +1 GB at 8 layers). Parts the step ran under no_grad stay so with grad on."""

    class PartlyFrozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen, self.head = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                h = self.frozen(x)
            return self.head(h)

    torch.manual_seed(0)
    m, x, y = PartlyFrozen(), torch.randn(4, 8), torch.randn(4, 8)
    rec = record_step(lambda: m(x), lambda out: F.mse_loss(out, y), model=m, batch={"inputs": x, "target": y})
    prog = decode(to_json(rec.program))
    assert {n.grad for n in prog.nodes} == {True, False}
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    step = StepModule(prog, state, [n for n, _ in m.named_parameters()], {}, rec.constants)
    with torch.no_grad():
        loss = step(x, y)
    assert loss.grad_fn is None and not loss.requires_grad
    assert torch.is_grad_enabled()
    step(x, y).backward()
    assert step.get_parameter("head.weight").grad is not None
    assert step.get_parameter("frozen.weight").grad is None
