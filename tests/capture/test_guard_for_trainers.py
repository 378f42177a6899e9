"""What the trainer integrations need from NanGuard, on its own: a loss a framework already scaled is recorded
unscaled (`loss_ok(scaled_by=)`), `end_step()` marks an optimizer step's end even when the step number does not
move, `last_trigger` says why the guard failed, and a check made inside `optimizer.step()` (where torch runs
under no_grad) still records a step whose backward replays."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.analysis import analyze
from nanreplay.enums import Trigger


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def test_scaled_by_records_the_loss_the_step_computed(tmp_path):
    model = _model()
    guard = NanGuard(model, loss_fn=F.mse_loss, folder=tmp_path)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    guard.begin(x, y, step=0)
    loss = F.mse_loss(model(x), y)
    assert guard.loss_ok(loss * 65536.0 / 4, scaled_by=65536.0 / 4)  # a GradScaler's scale, 4 accumulation steps
    assert guard.history[-1]["loss"] == float(loss)
    guard.begin(x, y, step=1)
    assert guard.loss_ok(loss, scaled_by=0.0) and guard.history[-1]["loss"] == float(loss)  # no factor: as is
    guard.begin(x, y, step=2)
    assert not guard.loss_ok(loss * float("nan"), scaled_by=2.0)
    assert guard.last_trigger == Trigger.LOSS


def test_end_step_starts_a_new_step_with_the_same_number(tmp_path):
    model = _model()
    guard = NanGuard(model, loss_fn=F.mse_loss, folder=tmp_path)
    x1, x2, y = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 1)
    guard.begin(x1, y, step=5)
    guard.begin(x2, y, step=5)
    assert len(guard._states) == 2  # the same step: micro-batches of it
    guard.end_step()
    guard.begin(x2, y, step=5)
    assert len(guard._states) == 1 and guard._states[0].batch["inputs"] is x2


def test_a_check_under_no_grad_records_a_step_whose_backward_replays(tmp_path):
    """Lightning's on_before_optimizer_step runs inside optimizer.step(), which torch runs under no_grad."""

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(6, 4)

        def forward(self, a, b):
            return ((self.enc(a) - self.enc(b)) ** 2).sum(-1).sqrt().mean()

    torch.manual_seed(0)
    model = Pair()
    guard = NanGuard(model, folder=tmp_path)
    a = torch.randn(4, 6)
    b = a + 0.3 * torch.randn(4, 6)
    b[1] = a[1]
    guard.begin((a, b), step=0)
    loss = model(a, b)
    assert guard.loss_ok(loss)
    loss.backward()
    with torch.no_grad():
        assert not guard.grads_ok()
    assert guard.last_trigger == Trigger.GRADIENT
    d = analyze(guard.last_snapshot, verify=False).to_json()
    assert "step program" in d["model"]["how"]
    assert d["verdict"] == "culprit_found" and d["culprit"]["phase"] == "backward"
