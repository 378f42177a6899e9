"""A finite gradient-norm spike from a corrupt target (#39), analyzed by the CLI with no flags: the analysis' norm is
the run's (every parameter counted, a one-element bias too), it says the spike reproduced, the carriers are ranked
by their share of the norm, and it names the target sample."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.report.views.banner import banner
from tests.clirun import run
from tests.tolerance import close


@pytest.fixture(scope="module")
def spike(tmp_path_factory):
    root = tmp_path_factory.mktemp("spike")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=root, spike_factor=5.0)
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
    (root / "elsewhere").mkdir()
    res = run("analyze", guard.spike_snapshots[0], "--no-report", "--json", "out.json", cwd=root / "elsewhere")
    assert res.exit_code == 0, res.output
    return json.loads((root / "elsewhere" / "out.json").read_text()), res.output


def test_the_spike_is_reproduced_with_the_runs_norm(spike):
    d, out = spike
    s = d["diagnosis"]["spike"]
    assert close(s["grad_norm"], s["recorded_grad_norm"]) and s["reproduced"] is True
    b = banner(d)
    assert b.verdict_label == "spike reproduced" and "not reproduced" not in b.headline.lower()
    assert "not reproduced" not in out and out.splitlines()[0].endswith(": spike reproduced")


def test_the_carriers_are_every_parameter_ranked_by_share(spike):
    s = spike[0]["diagnosis"]["spike"]
    names = [c["name"] for c in s["carriers"]]
    assert sorted(names) == ["bias", "weight"]  # the one-element bias is counted
    shares = [c["share"] for c in s["carriers"]]
    assert shares == sorted(shares, reverse=True) and sum(shares) > 0.999


def test_the_corrupt_target_is_named_like_an_input(spike):
    s = spike[0]["diagnosis"]["spike"]
    target = [o for o in s["outlier_samples"] if o["role"] == "target"]
    assert target and target[0]["samples"] == [5]
