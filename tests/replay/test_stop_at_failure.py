"""A fix that does not verify is replayed instrumented to name the next culprit; that replay stops backward as soon
as its failure can no longer change (`run(stop_at_failure=True)`), and the plain replay of a fix stops at the
first non-finite gradient. Both must answer exactly what the whole replay answers.

The family: models with several NaN sources, one per layer (a fully masked attention row masked again after
softmax, as in GPT-2 with a hand-written mask; sqrt at 0; a conv + batch norm + layer norm, whose backward ops
write a weight's and a bias's gradient in one op; a tied embedding). Each is replayed with the culprit's call
patched, then the next culprit's too, and so on until the step is finite: at every stage the stopped replay
names the same failure, chain and culprit as the whole one, and (where backward goes on past the failure) runs
fewer ops.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from nanreplay import culprit as culprit_mod
from nanreplay import replay
from nanreplay.replay.subject import Subject


class Attention(torch.nn.Module):
    """`layers` attention blocks; the last query of sample 1 attends to nothing in each: softmax makes its row
    NaN, the second mask hides it from the forward, backward through softmax is NaN. Tied embedding."""

    def __init__(self, layers=4, d=16, vocab=11):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"ln": torch.nn.LayerNorm(d),
                                                               "qkv": torch.nn.Linear(d, 3 * d)})
                                          for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        b, t, _ = h.shape
        keep = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t).clone()
        keep[1, t - 1, :] = False
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln"](h)).chunk(3, -1)
            att = q @ k.transpose(-1, -2)
            bias = torch.zeros_like(att).masked_fill(~keep, float("-inf"))  # additive: its gradient passes through
            att = (att + bias).softmax(-1).masked_fill(~keep, 0.0)
            h = h + att @ v
        return self.head(h)


class Sqrts(torch.nn.Module):
    """A distance of a tensor to itself in each layer: sqrt at 0, an Inf gradient times 0, NaN."""

    def __init__(self, layers=4, d=8):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for lin in self.lins:
            h = lin(x)
            x = x + (h - h).pow(2).sum(-1, keepdim=True).sqrt() + torch.tanh(h)
        return x


class BiasFirstNorm(torch.nn.Module):
    """A layer norm whose bias is registered before its weight: one backward op makes both gradients, the
    weight's is accumulated first (each AccumulateGrad is an event of its own), so the order of accumulation,
    not the order of the parameters, decides which gradient is the failure."""

    def __init__(self, shape):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(shape))
        self.weight = torch.nn.Parameter(torch.ones(shape))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias)


class ConvNorms(torch.nn.Module):
    """Conv (weight and bias gradients from one backward op), batch norm and layer norm (likewise), then a
    log masked where its input is 0 (its gradient there is still 0 * Inf) in every layer."""

    def __init__(self, layers=3):
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(3, 3, 3, padding=1) for _ in range(layers))
        self.bns = torch.nn.ModuleList(torch.nn.BatchNorm2d(3) for _ in range(layers))
        self.norms = torch.nn.ModuleList(BiasFirstNorm([3, 6, 6]) for _ in range(layers))
        self.ln = torch.nn.LayerNorm([3, 6, 6])

    def forward(self, x):
        for conv, bn, norm in zip(self.convs, self.bns, self.norms, strict=True):
            h = norm(bn(conv(x)))
            r = h * (h > 0)  # (a product, not relu: relu's backward would mask the NaN again)
            x = x + torch.where(r > 0, torch.log(r), 0.0) * 0.1 + h  # the where trap: log's gradient at 0 is NaN
        return self.ln(x)


def _subject(model: torch.nn.Module, inputs, loss) -> Subject:
    model.train()
    return Subject(model, inputs, None, loss, "loss", "test", torch.device("cpu"))


CASES = {
    "attention": lambda: _subject(Attention(), torch.randint(0, 11, (2, 5)), lambda out: out.float().pow(2).mean()),
    "sqrt": lambda: _subject(Sqrts(), torch.randn(6, 8), lambda out: out.sum()),
    "conv_norms": lambda: _subject(ConvNorms(), torch.randn(2, 3, 6, 6), lambda out: out.pow(2).mean()),
}


def _finite_input(func, args, kwargs):
    """The patch: the call on its first input with NaN/±Inf made finite, and sqrt/log kept away from 0."""
    name = getattr(func, "__name__", "")
    x = torch.nan_to_num(args[0], nan=0.0, posinf=1e4, neginf=-1e4)
    if name in ("sqrt", "log"):
        x = x.clamp(min=1e-6)
    return func(x, *args[1:], **kwargs)


def _summary(step: replay.Step) -> tuple:
    f = step.failure
    if f is None:
        return (None,)
    ch = culprit_mod.chain(step.events, f.event)
    c = culprit_mod.culprit(step.events, ch)
    ev = step.events[c] if c is not None else None
    culprit = None if ev is None else (ev.index, ev.phase, ev.op, ev.role, ev.fwd, ev.node, step.module_of(ev))
    events = [(e.index, e.phase, e.op, e.kind, e.role, e.parents, e.out, e.fwd, e.node) for e in
              (step.events[i] for i in ch)]
    return (f.what, f.name, f.kind, f.event), ch, events, culprit, repr(step.loss)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stopped_replay_names_what_the_whole_replay_names_at_every_stage(case):
    torch.manual_seed(0)
    subject = CASES[case]()
    patches: dict = {}
    stages = stopped_early = 0
    for _ in range(12):
        whole = replay.run_subject(subject, intercepts=dict(patches), backward_after_bad_loss=False)
        subject.model.zero_grad(set_to_none=True)
        stopped = replay.run_subject(subject, intercepts=dict(patches), backward_after_bad_loss=False,
                                     stop_at_failure=True)
        subject.model.zero_grad(set_to_none=True)
        assert _summary(stopped) == _summary(whole), f"stage {stages}"
        assert stopped.grads == [] and whole.grads
        plain = replay.run_patched(subject, dict(patches))
        assert (plain is None) == (whole.failure is not None), f"stage {stages}"
        if whole.failure is None:
            break
        stages += 1
        stopped_early += len(stopped.events) < len(whole.events)
        c = culprit_mod.culprit(whole.events, culprit_mod.chain(whole.events, whole.failure.event))
        ev = whole.events[c]
        call = whole.ops[ev.fwd].call if ev.fwd is not None else 0
        assert call and call not in patches, f"stage {stages}: the culprit's call is not patchable ({ev.op})"
        patches[call] = _finite_input
    else:
        pytest.fail("the step never came out finite")
    assert stages >= 2  # the family has more than one NaN source: the next culprit is asked for at least once
    assert stopped_early, "no stage stopped backward before its end"


def test_a_patched_replay_that_fails_stops_at_the_first_nonfinite_gradient(monkeypatch):
    """run_patched answers None without the rest of backward: fewer backward ops run than in a whole step."""
    subject = CASES["attention"]()
    counted: list[int] = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counted[-1] += 1
            return func(*args, **(kwargs or {}))

    for stop in (True, False):
        counted.append(0)
        if not stop:  # the same replay with a hook that never stops: the whole backward
            monkeypatch.setattr(importlib.import_module("nanreplay.replay.run"), "_finite_or_stop", lambda p, rec: None)
        with Count():
            assert replay.run_patched(subject, {}) is None
    assert counted[0] < counted[1]


def test_grad_norm_is_the_float64_norm_within_float32_rounding():
    torch.manual_seed(0)
    for g in (torch.randn(100_000) * 1e-3, torch.randn(50) * 1e-25, torch.randn(40) * 1e25, torch.zeros(3),
              torch.randn(7).double(), torch.randn(9).half()):
        want = float(torch.linalg.vector_norm(g.double()))
        got = replay.grad_norm(g)
        assert got == pytest.approx(want, rel=1e-6, abs=0.0), g.dtype
    assert replay.grad_norm(torch.tensor([1.0, float("nan")])) != replay.grad_norm(torch.tensor([1.0, 0.0]))
