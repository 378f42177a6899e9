"""A gradient vanishing from the first step (capture/vanish.py's floor): a deep sigmoid MLP at its default init fires
`gradient_vanished` on its third step, naming its input end; a healthy MLP of the same depth does not; the fix the
analysis gives, applied to the loop, lifts the first layer's share by orders of magnitude and the loss falls."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.analysis import analyze

DEPTH, WIDTH = 12, 8


def _mlp(act: type[nn.Module], norm: bool = False, kaiming: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        lin = nn.Linear(WIDTH, WIDTH)
        if kaiming:
            nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")
            nn.init.zeros_(lin.bias)
        layers += [lin, *([nn.LayerNorm(WIDTH)] if norm else []), act()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, WIDTH, generator=g)
    return x, x[:, :2].sum(1, keepdim=True) * 3 + 5


def _train(tmp_path, model, steps: int, opt=None, check_flow=True):
    """(guard, losses, the first layer's share of the gradient norm on each step)."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, check_flow=check_flow)
    losses, shares = [], []
    for step in range(steps):
        x, y = _batch(step)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        guard.loss_ok(loss)
        loss.backward()
        guard.grads_ok()
        total = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in model.parameters()))
        shares.append(math.sqrt(sum(float(p.grad.norm()) ** 2 for p in model[0].parameters())) / total)
        losses.append(loss.item())
        opt.step()
    return guard, losses, shares


def test_a_deep_sigmoid_mlp_at_its_default_init_fires_from_the_start_and_names_its_input_end(tmp_path):
    guard, _losses, shares = _train(tmp_path, _mlp(nn.Sigmoid), steps=4)
    (path,) = guard.flow_snapshots
    assert "gradient_vanished" in path and "step000002" in path  # the third step: below the floor on steps 0-2
    assert max(shares[:3]) < 1e-7
    gf = torch.load(path, weights_only=True)["gradient_flow"]
    names = [v["module"] for v in gf["vanished"]]
    assert names[:3] == ["0", "2", "4"] and str(2 * DEPTH) not in names  # the input end; the output layer learns
    assert all(v["share"] < v["floor"] and len(v["first_shares"]) == 3 for v in gf["vanished"])
    d = analyze(path).to_json()
    flow = d["gradient_flow"]
    assert d["verdict"] == "gradient_vanished" and flow["reproduced"] is True and flow["from_start"] is True
    assert {"0.weight", "0.bias", "2.weight"} <= set(flow["parameters"])
    diag = d["diagnosis"]
    assert diag["cause"] == "gradient_vanished" and diag["fix"]["kind"] == "non_saturating"
    assert "from the first step" in diag["explanation"] and "'0'" in diag["explanation"]
    assert "GELU or ReLU" in diag["fix"]["code"] and diag["fix"]["verified"] is None


def test_healthy_mlps_of_the_same_depth_and_the_floor_turned_off_write_nothing(tmp_path):
    for i, model in enumerate([_mlp(nn.ReLU, norm=True), _mlp(nn.GELU, kaiming=True)]):
        assert _train(tmp_path / str(i), model, steps=6)[0].flow_snapshots == []
    assert _train(tmp_path / "off", _mlp(nn.Sigmoid), steps=6,
                  check_flow={"vanish_floor": None})[0].flow_snapshots == []


def test_the_fix_applied_lifts_the_first_layers_share_by_orders_of_magnitude_and_the_loss_falls(tmp_path):
    """The analysis' fix (GELU with a Kaiming init in place of the sigmoids), judged by training on, not by the
    tool's verdict: the same loop, 150 steps of Adam."""
    runs = {}
    for name, model in [("bug", _mlp(nn.Sigmoid)), ("fixed", _mlp(nn.GELU, kaiming=True))]:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        runs[name] = _train(tmp_path / name, model, steps=150, opt=opt)
    bug, fixed = runs["bug"], runs["fixed"]
    assert [p.split("_")[-2] for p in bug[0].flow_snapshots] == ["vanished"] and fixed[0].flow_snapshots == []
    assert min(fixed[2]) > 1e4 * max(bug[2])  # the first layer's share: orders of magnitude up on every step
    last = lambda losses: sum(losses[-10:]) / 10  # noqa: E731
    assert last(fixed[1]) < last(bug[1]) / 2 and last(fixed[1]) < fixed[1][0] / 4
