"""A finite gradient-norm spike from a corrupt target (#39): the analysis' norm is the run's (every parameter
counted, a one-element bias too), it says the spike reproduced, and it names the target sample."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.analysis import analyze
from nanreplay.report.views.banner import banner
from tests.tolerance import close


def test_a_spike_from_one_corrupt_target_is_reproduced_with_the_runs_norm_and_names_the_target(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, spike_factor=5.0)
    for step in range(13):
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        if step == 12:
            y[5] = 3e4  # one corrupt label
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        guard.loss_ok(loss)
        loss.backward()
        guard.grads_ok()
        opt.step()
    assert len(guard.spike_snapshots) == 1 and "step000012" in guard.spike_snapshots[0]
    d = analyze(guard.spike_snapshots[0]).to_json()
    spike = d["diagnosis"]["spike"]
    assert close(spike["grad_norm"], spike["recorded_grad_norm"])
    assert spike["reproduced"] is True
    assert "bias" in [c["name"] for c in spike["carriers"]]  # the one-element parameter is counted
    assert sum(c["share"] for c in spike["carriers"]) > 0.999
    target = [o for o in spike["outlier_samples"] if o["role"] == "target"]
    assert target and target[0]["samples"] == [5]
    b = banner(d)
    assert b.verdict_label == "spike reproduced" and "not reproduced" not in b.headline.lower()
