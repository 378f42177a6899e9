"""A checkpointed program replay: the same loss and gradients, bit for bit, from a fraction of the saved
activations. The float64 precision probe of a gradient failure runs this way (a float64 graph is twice
the step's); a segment that writes into what it did not make runs plainly, since its recomputation would
read what the first run wrote (a buffer no node reads is the exception)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay.capture.program import record_step
from nanreplay.formats.program import decode, to_json
from nanreplay.formats.segments import checkpoint_plan
from nanreplay.formats.stepmodel import StepModule


class Block(nn.Module):
    def __init__(self, d, inplace=False):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)
        self.inplace = inplace

    def forward(self, x):
        if self.inplace:
            x = F.relu(x, inplace=True)  # writes into the block's input: its recomputation would read that
        h = F.relu(self.fc1(x), inplace=True)  # writes into a tensor the block made: fine
        return x + self.drop(self.fc2(h))


class Net(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, inplace=i == 1) for i in range(n))
        self.norm = nn.BatchNorm1d(d)  # running stats and batch counter: written in place, never read in train mode
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _step_module():
    torch.manual_seed(0)
    m, x, y = Net().train(), torch.randn(32, 16), torch.randint(0, 3, (32,))
    rec = record_step(lambda: m(x), lambda out: F.cross_entropy(out, y), model=m, batch={"inputs": x, "target": y})
    prog = decode(to_json(rec.program))
    return _maker(m, prog, rec), x, y, prog


def _maker(m, prog, rec):
    """StepModules of the recorded step, each with its own weights and buffers (a StepModule adopts them)."""
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    params = [n for n, _ in m.named_parameters()]
    return lambda: StepModule(prog, {k: v.clone() for k, v in state.items()}, params, {}, rec.constants)


def _plain_and_checkpointed(make, x, y):
    """Both replays; the loss and every gradient must be bit-identical."""
    plain, step = _run(make(), x, y), make()
    assert step.checkpointed()
    lean = _run(step, x, y)
    assert torch.equal(plain[0], lean[0])
    for name in plain[1]:
        assert torch.equal(plain[1][name], lean[1][name]), name
    return plain, lean


def _run(step, x, y):
    packed = [0]

    def pack(t):
        packed[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step(x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in step.named_parameters()}
    buffers = {n: b.clone() for n, b in step.named_buffers()}
    return loss.detach(), grads, buffers, packed[0]


def test_checkpointed_replay_is_bit_identical_and_saves_less():
    make, x, y, prog = _step_module()
    plan = checkpoint_plan(prog)
    marked = {s.unit for s in plan if s.unit}
    assert {"blocks.0", "blocks.2", "blocks.3", "norm"} <= marked
    assert "blocks.1" not in marked  # relu_ on the block's input
    plain, lean = _plain_and_checkpointed(make, x, y)
    # the recomputed BatchNorm counted the batch twice: a checkpointed replay's buffers are not the step's
    assert int(lean[2]["norm.num_batches_tracked"]) == int(plain[2]["norm.num_batches_tracked"]) + 1
    assert lean[3] < plain[3] / 2, (lean[3], plain[3])  # what autograd keeps outside the checkpoints


class Counted(nn.Module):
    """Counts its calls in a buffer and reads the count: recomputing it would see 2 where the step saw 1."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x) * self.calls


def test_a_buffer_some_node_reads_keeps_its_segment_plain():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), Counted(8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    rec = record_step(lambda: m(x), lambda out: F.cross_entropy(out, y), model=m, batch={"inputs": x, "target": y})
    prog = decode(to_json(rec.program))
    marked = {s.unit for s in checkpoint_plan(prog) if s.unit}
    assert "1" not in marked and {"0", "2", "4"} <= marked
    plain, lean = _plain_and_checkpointed(_maker(m, prog, rec), x, y)
    assert torch.equal(plain[2]["1.calls"], lean[2]["1.calls"])


def test_no_plan_for_a_model_without_enough_module_calls():
    torch.manual_seed(0)
    m, x = nn.Linear(4, 2), torch.randn(3, 4)
    rec = record_step(lambda: m(x), lambda out: out.square().mean(), model=m, batch={"inputs": x, "target": None})
    prog = decode(to_json(rec.program))
    assert checkpoint_plan(prog) is None
    step = StepModule(prog, dict(m.state_dict()), [n for n, _ in m.named_parameters()], {}, rec.constants)
    assert step.checkpointed() is False


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        h = self.bn(self.conv(x))
        h += x  # into a tensor the block made: recomputable
        return F.relu(h, inplace=True)


def test_a_resnet_is_split_into_its_residual_blocks_not_into_one_layers_call():
    """The depth is chosen by what it would hold: `layers` (one call holding everything) saves nothing; its
    residual blocks, with their BatchNorms, are the segments."""
    torch.manual_seed(0)
    m = nn.Sequential()
    m.stem = nn.Conv2d(3, 4, 3, padding=1)
    m.layers = nn.Sequential(*[Residual(4) for _ in range(3)])
    m.pool, m.flat, m.fc = nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 3, (2,))
    rec = record_step(lambda: m(x), lambda out: F.cross_entropy(out, y), model=m, batch={"inputs": x, "target": y})
    prog = decode(to_json(rec.program))
    marked = [s.unit for s in checkpoint_plan(prog) if s.unit]
    assert {"layers.0", "layers.1", "layers.2"} <= set(marked) and "layers" not in marked
    _plain_and_checkpointed(_maker(m, prog, rec), x, y)



class Window(nn.Module):
    """Overlapping windows by as_strided (Longformer's chunks)."""

    def __init__(self, d=8):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        h = self.proj(x).transpose(0, 1)  # (16, 2, 8), strides (8, 128, 1)
        chunks = h.as_strided((3, 8, 2, 8), (4 * h.stride(0), h.stride(0), h.stride(1), 1))
        return chunks.pow(2).mean()


def test_an_as_strided_view_replays_in_a_checkpointed_segment_as_in_a_plain_replay():
    """The replay makes an as_strided's view (its take carries the strides): inside a recomputed segment too,
    and both replays equal eager bit for bit (the same computation on the same machine)."""
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), Window()), torch.randn(2, 16, 8)
    rec = record_step(lambda: m(x), lambda out: out, model=m, batch={"inputs": x})
    prog = decode(to_json(rec.program))
    assert "3" in [s.unit for s in checkpoint_plan(prog) if s.unit]  # the window's segment
    plain, _ = _plain_and_checkpointed(_maker(m, prog, rec), x, None)
    loss = m(x)
    loss.backward()
    assert torch.equal(loss.detach(), plain[0])
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, plain[1][n]), n
