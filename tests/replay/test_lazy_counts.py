"""The replay counts NaN/±Inf exactly only for events that can be on the failure's chain (`Recorder.counted`):
past the first complete non-finite parameter gradient, an event records its kinds by its sum and no counts.
Every chain, culprit and failure must be what a replay that counts every event names, counts included; a failure
recorded past that point (a gradient made finite again after it was complete) replays counting everything."""

from __future__ import annotations

import pytest
import torch

from nanreplay import replay
from tests.replay.test_stop_at_failure import CASES, _subject, _summary


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_lazy_replay_names_the_chain_and_culprit_of_the_counting_one_with_their_counts(case):
    torch.manual_seed(0)
    subject = CASES[case]()
    lazy = replay.run_subject(subject)
    subject.model.zero_grad(set_to_none=True)
    full = replay.run_subject(subject, lazy_counts=False)
    subject.model.zero_grad(set_to_none=True)
    assert _summary(lazy) == _summary(full)
    assert lazy.grads == full.grads
    assert [(e.kind, e.phase, e.node, e.op) for e in lazy.events] == [(e.kind, e.phase, e.node, e.op) for e in full.events]
    assert all(isinstance(e.out["nan"], int) for e in full.events)
    if lazy.failure is not None and lazy.failure.what == "gradient":
        uncounted = [e.index for e in lazy.events if e.out["nan"] is None]
        assert uncounted and min(uncounted) > lazy.failure.event  # the point of it: events past the failure's


class Sanitized(torch.nn.Module):
    """sqrt(y * 0): a finite loss, NaN from the gradient on. A hook on the hidden activation, run once the head's
    gradients are complete (and seen non-finite), makes them finite in place: the failure is then the first
    layer's gradient, an event recorded after the head's was complete."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        h = self.lin(x)
        if h.requires_grad:
            h.register_hook(lambda g: [p.grad.nan_to_num_(0.0) for p in self.head.parameters()] and None)
        return torch.sqrt(self.head(h) * 0)


def test_a_failure_past_the_first_nonfinite_gradient_is_replayed_counting_everything():
    torch.manual_seed(0)
    subject = _subject(Sanitized(), torch.randn(3, 4), lambda out: out.sum())
    lazy = replay.run_subject(subject)
    subject.model.zero_grad(set_to_none=True)
    full = replay.run_subject(subject, lazy_counts=False)
    assert lazy.failure is not None and lazy.failure.name.startswith("lin.")
    assert _summary(lazy) == _summary(full)
    assert all(isinstance(e.out["nan"], int) for e in lazy.events)  # the replay that counted everything
