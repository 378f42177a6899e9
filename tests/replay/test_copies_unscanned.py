"""The replay does not sum the output of an op that only moves values (replay/copies.py) when each of its inputs
was proved finite and not written since: it records exactly what the replay that sums every output records.

The family: the step-at-failure models (masked attention rows with a -inf fill, sqrt at 0, conv + norms), and the
ways a proved tensor can stop being finite behind the replay's back: written in place through a view, written
through `.data` (another version counter), NaN arriving in the batch, a cast that narrows (float32 -> float16
overflows), a fill value that is not finite.
"""

from __future__ import annotations

import pytest
import torch

from nanreplay import replay
from nanreplay.replay import copies
from tests.replay.test_stop_at_failure import CASES, _subject


class ViewWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x).detach()  # (written in place: autograd must not need it)
        h[0].mul_(float("inf"))  # through a view: the base's version moves with it
        return self.b(torch.cat([h, h.clone()], -1))


class DataWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        h.data[1, 2] = float("nan")  # `.data` has a version counter of its own: h's does not move
        return self.b(h.clone().relu())


class Narrowing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        h = (self.a(x) * 1e6).clone()
        return self.b(h.to(torch.float16).to(torch.float32))  # float16 overflows: inf, a real culprit


class Fills(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        h = torch.where(h > 0, h, h.neg()).masked_fill(h.abs() < 1e-3, 0.0)  # copies with finite fills
        h = torch.nn.functional.pad(h, (0, 1), value=float("-inf"))[..., :4]  # a -inf pad, sliced away again
        return self.b(h.masked_fill(h > 0.5, float("inf")))  # a fill that is not finite


def _nan_batch():
    x = torch.randn(3, 4)
    x[2, 1] = float("nan")
    return x


MORE = {
    "view_write": lambda: _subject(ViewWrite(), torch.randn(3, 4), lambda out: out.sum()),
    "data_write": lambda: _subject(DataWrite(), torch.randn(3, 4), lambda out: out.sum()),
    "narrowing": lambda: _subject(Narrowing(), torch.randn(3, 4), lambda out: out.sum()),
    "fills": lambda: _subject(Fills(), torch.randn(3, 4), lambda out: out.sum()),
    "nan_batch": lambda: _subject(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)),
                                  _nan_batch(), lambda out: out.sum()),
}


def _everything(step: replay.Step) -> tuple:
    f = step.failure
    events = [(e.index, e.phase, e.op, e.kind, e.role, e.parents, e.out, e.fwd, e.node) for e in step.events]
    return (None if f is None else (f.what, f.name, f.kind, f.event)), events, repr(step.loss), step.grads


def _replay(make, monkeypatch, skip: bool) -> tuple[tuple, int]:
    sums = []
    real = torch.Tensor.sum

    def counted(t, *a, **k):
        sums.append(1)
        return real(t, *a, **k)

    torch.manual_seed(0)
    subject = make()
    with monkeypatch.context() as m:
        if not skip:
            m.setattr(copies, "COPIES", frozenset())
        m.setattr(torch.Tensor, "sum", counted)
        step = replay.run_subject(subject, lazy_counts=False)
    return _everything(step), len(sums)


@pytest.mark.parametrize("case", sorted(CASES) + sorted(MORE))
def test_unscanned_copies_record_what_scanning_them_records(case, monkeypatch):
    make = {**CASES, **MORE}[case]
    skipped, n_skip = _replay(make, monkeypatch, skip=True)
    scanned, n_scan = _replay(make, monkeypatch, skip=False)
    assert skipped == scanned
    assert skipped[0] is not None  # each case fails somewhere: the events are not vacuous
    assert n_skip <= n_scan


def test_a_transformer_step_scans_fewer_outputs():
    """The point of it: a healthy transformer block's copies (head reshapes, the causal mask's finite fill, cat)
    are proved by their inputs, not summed again."""
    from benchmarks import transformer as tf

    torch.manual_seed(0)
    model = tf.Transformer(layers=1, d=32, heads=2)
    idx = torch.randint(0, tf.VOCAB, (2, tf.SEQ))
    results = {}
    for skip in (True, False):
        with pytest.MonkeyPatch.context() as m:
            made = lambda: _subject(model, idx, lambda out: out.float().pow(2).mean())  # noqa: E731
            results[skip] = _replay(made, m, skip)
        model.zero_grad(set_to_none=True)
    (skipped, n_skip), (scanned, n_scan) = results[True], results[False]
    assert skipped == scanned and skipped[0] is None  # healthy: no failure, the same loss and gradients
    assert n_skip < 0.9 * n_scan, (n_skip, n_scan)
