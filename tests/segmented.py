"""Small step programs with one NaN source in one block of four (a NanGuard loop: two healthy steps, then the
faulty one): the precision probe's seeded segments and the candidates' shared forward are tested on them."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard


class Block(nn.Module):
    def __init__(self, d: int, fault: str | None = None):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.fault, self.on = fault, False

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.on and self.fault == "relu_log":  # a zero made here: log(0) in any dtype
            g = F.relu(h[:, :4])
            h = h + (g * torch.log(g)).sum(-1, keepdim=True)
        if self.on and self.fault == "dist":  # a distance of each row to itself: sqrt at an exact 0, backward 1/0
            g = h[:, :4]
            h = h + 1e-3 * ((g[:, None] - g[None]) ** 2).sum(-1).sqrt().mean(-1, keepdim=True)
        if self.on and self.fault == "masked_log":  # log of probabilities that underflow in float32 only, masked
            p = torch.softmax(200 * h, -1)          # in forward: backward divides by the zeros
            h = h + torch.where(p > 0, torch.log(p), 0.0).mean(-1, keepdim=True)
        if self.on and self.fault == "over_zero":  # x / clamp(..., 0, 1) with zeros: each ε sets the loss (x / ε)
            h = h + (x[:, :1].abs() / h[:, :1].clamp(0, 1)).mean()  # (a ReLU there would get softplus)
        if self.on and self.fault == "softmax":  # hands over probabilities that underflow in float32 only
            return torch.softmax(200 * h, -1)
        if self.on and self.fault == "relu_out":  # hands over a ReLU's exact zeros
            return F.relu(h)
        if self.on and self.fault == "log_in":  # the log of what the block before handed over
            return x + torch.log(x).mean(-1, keepdim=True)
        return x + h


class Net(nn.Module):
    def __init__(self, faults: dict[int, str], d: int = 16, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, faults.get(i)) for i in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


CASES = {"relu_log": {2: "relu_log"}, "underflow": {1: "softmax", 2: "log_in"}, "relu_boundary": {1: "relu_out", 2: "log_in"},
         "dist": {2: "dist"}, "masked_log": {2: "masked_log"}, "relu_log_bf16": {2: "relu_log"}, "dist_bf16": {2: "dist"}}
VERIFY_CASES = {"over_zero": {2: "over_zero"}}  # fix verification only (tests/diagnose/test_deferred_reference.py)


def snapshot(tmp_path, faults: dict[int, str], autocast: bool = False):
    torch.manual_seed(0)
    model = Net(faults)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=tmp_path)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):  # two healthy steps, then the faulty one
            for b in model.blocks:
                b.on = step == 2
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
            guard.begin(x, y, step=step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # rows: float32, then float64
                loss = F.cross_entropy(model(x).float(), y)
            if not guard.step(loss):
                break
    assert guard.last_snapshot is not None
    return guard.last_snapshot
