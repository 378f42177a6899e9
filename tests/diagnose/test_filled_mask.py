"""A masked mean whose mask the code fills (`keep = torch.ones_like(x); keep[pad] = 0`) is a masked mean: over
an all-padding row it is 0/0 — the masked_mean_empty rule, not a generic division by zero — and its fix keeps the
count at least 1 on the user's own line. The training code is not importable where the snapshot is analyzed (the
zoo's masked_mean fault, judged by benchmarks/zoo_applied.py, builds its mask this way)."""

from __future__ import annotations

from isolation import analyze_isolated, load_training_code, marker_line

TRAINING = r'''
import torch
import torch.nn as nn
from nanreplay import NanGuard


def pooled_loss(tokens, target):
    pad = target[1]
    keep = torch.ones_like(tokens)
    keep[pad] = 0
    pooled = (tokens * keep).sum(-1) / keep.sum(-1)  # LINE: pooled
    return ((pooled - target[0]) ** 2).mean()


def run(folder):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(-2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=pooled_loss, folder=folder)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(3, 5, 4, generator=g)
        pad = torch.zeros(3, 5, dtype=torch.bool)
        if step == 2:
            pad[1] = True  # a sequence that is all padding
        y = (torch.randn(3, generator=g), pad)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = pooled_loss(model(x), y)
        if not guard.loss_ok(loss):
            break
        loss.backward()
        if not guard.grads_ok():
            break
        opt.step()
    return guard.last_snapshot
'''


def test_a_filled_mask_over_an_all_padding_row_is_a_masked_mean_fixed_on_its_line(tmp_path):
    mod = load_training_code(tmp_path / "proj", "filledmask", TRAINING)
    path = mod.run(str(tmp_path / "snaps"))
    assert path is not None
    d = analyze_isolated([str(path)], tmp_path / "elsewhere", also_blocked=("filledmask",))[str(path)]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "pooled")
    diag = d["diagnosis"]
    assert diag["cause"] == "masked_mean_empty", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["kind"] == "guard_empty_reduction" and fix["verified"] is True, fix.get("verification")
    assert fix["after"].split("#")[0].rstrip().endswith("keep.sum(-1).clamp_min(1)"), fix["after"]
