"""Outputs an op returns as workspace for its own backward are not values: the replay neither checks them for NaN/Inf
nor reads them as an input's kind (replay/recorder.py VALUE_OUTPUTS).

aten._ctc_loss's second output, log_alpha, is allocated uninitialised and written only where an alignment can reach:
for a sample whose target is shorter than the batch's longest, the rest holds whatever the memory held. An earlier
replay in the same process could leave NaN there, so the CTC culprit once read as a NaN (and its cause
"unrecognised") in a loaded suite run; torch.use_deterministic_algorithms fills such memory with NaN every time,
which makes that run reproducible here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanreplay import analysis, replay
from nanreplay import culprit as culprit_mod
from nanreplay.replay.subject import Subject

TARGETS = torch.tensor([[1, 2, 0, 0], [3, 3, 3, 3]])  # the second needs 7 frames (3 _ 3 _ 3 _ 3), not 4


class CTCHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)

    def forward(self, x, target_lengths):
        lp = F.log_softmax(self.fc(x), -1)
        return F.ctc_loss(lp, TARGETS, torch.full((2,), 4, dtype=torch.long), target_lengths)  # CULPRIT: ctc


def ctc_head():
    torch.manual_seed(0)
    return CTCHead()


def _batch(infeasible: bool) -> tuple:
    return torch.randn(4, 2, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([2, 4 if infeasible else 2])


@pytest.fixture
def unwritten_memory_is_nan():
    """Deterministic algorithms fill uninitialised memory with NaN (fill_uninitialized_memory, on by default)."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    x, lengths = _batch(True)
    log_alpha = torch.ops.aten._ctc_loss(torch.randn(4, 2, 6).log_softmax(-1), TARGETS, torch.tensor([4, 4]),
                                         lengths, 0, False)[1]
    assert log_alpha.isnan().any()  # the premise: the workspace holds NaN where no alignment reaches
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn)


def _replay(infeasible: bool) -> replay.Step:
    model = ctc_head().train()
    return replay.run_subject(Subject(model, _batch(infeasible), None, None, "loss", "test", torch.device("cpu")))


def test_the_ctc_culprit_is_its_loss_inf_not_the_workspace_nan(unwritten_memory_is_nan):
    step = _replay(infeasible=True)
    ctc = [e for e in step.events if e.op.startswith("aten._ctc_loss")]
    assert ctc and ctc[0].phase == "forward" and ctc[0].kind == "inf", [(e.op, e.kind, e.out) for e in step.events]
    assert ctc[0].out == {"numel": 2, "nan": 0, "posinf": 1, "neginf": 0}  # the loss of 2 samples, one infeasible


def test_a_feasible_ctc_step_records_no_event(unwritten_memory_is_nan):
    # log_alpha's first frame is -inf by construction and the rest NaN here: neither is a value of the step
    step = _replay(infeasible=False)
    assert step.failure is None and step.events == [], [(e.op, e.kind, e.out) for e in step.events]


def test_the_analysis_names_the_ctc_cause_and_verifies_zero_infinity(unwritten_memory_is_nan, tmp_path):
    x, lengths = _batch(True)
    path = tmp_path / "ctc.pt"
    torch.save({"x": (x, lengths), "state": ctc_head().state_dict()}, path)
    d = analysis.analyze(path, model=f"{__name__}:ctc_head").to_json()
    assert d["culprit"]["op"].startswith("aten._ctc_loss") and d["culprit"]["kind"] == "inf", d["culprit"]
    diag = d["diagnosis"]
    assert diag["cause"] == "ctc_infeasible", (diag["cause"], diag["title"])
    assert diag["fix"]["kind"] == "zero_infinity" and diag["fix"]["verified"] is True, diag["fix"]["verification"]


class Concatenated(torch.nn.Module):
    """A concatenation written by hand into a buffer new_empty made; the log of a negative activation goes into its
    second half: the log is the origin, not the buffer's unwritten memory."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        h = self.fc(x)
        buf = h.new_empty(4, 6)
        buf[:, :3] = h
        buf[:, 3:] = h.log()  # CULPRIT: log
        return buf.sum()


def test_an_empty_buffers_memory_is_no_origin_of_what_is_written_into_it(unwritten_memory_is_nan):
    torch.manual_seed(0)
    model = Concatenated().train()
    step = replay.run_subject(Subject(model, torch.randn(4, 3), None, None, "loss", "test", torch.device("cpu")))
    assert step.failure is not None and step.failure.what == "loss"
    assert not [e for e in step.events if "empty" in e.op], [(e.op, e.kind) for e in step.events]
    chain = culprit_mod.chain(step.events, step.failure.event)
    c = step.events[culprit_mod.culprit(step.events, chain)]
    assert c.op == "aten.log.default" and c.role == "origin" and c.kind == "nan", [(e.op, e.role) for e in step.events]
