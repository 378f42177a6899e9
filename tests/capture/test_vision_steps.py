"""Vision and metric-learning steps from the open-world audit that used to leave a snapshot needing --model: a
spatial transformer (`F.affine_grid` -> `aten.affine_grid_generator`, then `grid_sample`) with an antialiased resize
(`F.interpolate(..., antialias=True)` -> `aten._upsample_bilinear2d_aa`), and a pairwise metric loss (`F.pdist`,
`torch.triu_indices`, `torch.isin`, `torch.quantile`'s `ceil_`). Each trains guarded and unguarded (bitwise equal),
then breaks at step 2 and is analyzed with no flags."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from isolation import guard_invisible

from nanreplay import NanGuard
from nanreplay.analysis import analyze


class SpatialTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.loc = nn.Sequential(nn.Flatten(), nn.Linear(64, 6))
        self.head = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3))
        with torch.no_grad():
            self.loc[1].weight.zero_()
            self.loc[1].bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))  # starts at the identity, as STNs do

    def forward(self, x):
        x = (x - x.mean((2, 3), keepdim=True)) / x.std((2, 3), keepdim=True)  # LINE: stn
        grid = F.affine_grid(self.loc(x).view(-1, 2, 3), [x.shape[0], 1, 8, 8], align_corners=False)
        warped = F.grid_sample(x, grid, align_corners=False)
        return self.head(F.interpolate(warped, size=(4, 4), mode="bilinear", antialias=True))


def _train(folder, guarded: bool, bad: int | None):
    torch.manual_seed(0)
    model = SpatialTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=folder, check_flow=False) if guarded else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(3):
        x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        if step == bad:
            x[2] = 0.5  # a blank image: zero standard deviation, 0 / 0
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if guard and not guard.loss_ok(loss):
            break
        loss.backward()
        if guard and not guard.grads_ok():
            break
        opt.step()
        losses.append(loss.detach().clone())
    return losses, model, guard


def test_a_spatial_transformer_with_an_antialiased_resize_records_and_localises(tmp_path):
    plain, m0, _ = _train(tmp_path / "off", False, None)
    guarded, m1, guard = _train(tmp_path / "on", True, None)
    assert len(plain) == len(guarded) == 3 and all(torch.equal(a, b) for a, b in zip(plain, guarded, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters(), strict=True))
    _, _, guard = _train(tmp_path / "bad", True, 2)
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap["program_error"] is None
    result = analyze(guard.last_snapshot, verify=False).to_json()
    c = result["culprit"]
    assert (result["verdict"], c["forward_op"]) == ("culprit_found", "aten.div.Tensor"), result.get("warnings")
    assert c["source"]["code"].endswith("# LINE: stn")


class PairMetric(nn.Module):
    """A metric-learning loss over every pair of the batch: pdist, triu_indices pairs, an isin label mask and a
    quantile margin (quantile runs ceil_)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x, labels):
        z = self.enc(x)
        d = F.pdist(z)
        i, j = torch.triu_indices(x.shape[0], x.shape[0], 1)
        known = ~torch.isin(labels, torch.tensor([-1]))
        same = (labels[i] == labels[j]) & known[i] & known[j]
        margin = torch.quantile(d.detach(), 0.5)
        pos = -torch.log(torch.exp(-d[same]) + 1e-3).mean()
        return pos + torch.log(d[~same]).neg().clamp(min=-margin).mean()  # LINE: pairs


def test_a_pairwise_metric_loss_records_and_localises(tmp_path):
    """Before, `_pdist_forward`, `triu_indices`, `isin` and quantile's `ceil_` each left the snapshot needing --model."""
    def train(folder, guarded, bad):
        torch.manual_seed(0)
        model = PairMetric()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        guard = NanGuard(model, opt, folder=folder, check_flow=False) if guarded else None
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(3):
            x, labels = torch.randn(6, 6, generator=g), torch.tensor([0, 0, 1, 1, 2, -1])
            if step == bad:
                x[4] = x[2]  # a duplicated sample of another class: distance 0, log(0)
            if guard:
                guard.begin((x, labels), step=step)
            opt.zero_grad()
            loss = model(x, labels)
            if guard and not guard.loss_ok(loss):
                break
            loss.backward()
            if guard and not guard.grads_ok():
                break
            opt.step()
            losses.append(loss.detach().clone())
        return losses, model, guard

    guard_invisible(train, tmp_path, 3)
    _, _, guard = train(tmp_path / "bad", True, 2)
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap["program_error"] is None
    result = analyze(guard.last_snapshot, verify=False).to_json()
    c = result["culprit"]
    assert (result["verdict"], c["forward_op"]) == ("culprit_found", "aten.log.default"), result.get("warnings")
    assert c["source"]["code"].endswith("# LINE: pairs")
