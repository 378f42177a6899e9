"""NanGuard's choices for sharded models, in this process (a world of one rank): a folder only with
sync_ranks=True, `sharded=` to choose, and a one-rank folder analyzes like any other."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.analysis import analyze


@pytest.fixture
def world_of_one(tmp_path):
    dist = torch.distributed
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Sqrt(nn.Module):
    def forward(self, x):
        return x.sqrt()


def fsdp_model():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(Sqrt(), nn.Sequential(nn.Linear(3, 4)), nn.Linear(4, 1))
    fully_shard(model[1])
    fully_shard(model)
    return model


def run(guard, model):
    x, y = torch.rand(5, 3), torch.randn(5, 1)
    x[2, 1] = -1.0
    guard.begin(x, y, step=0)
    return guard.step(F.mse_loss(model(x), y))


def test_a_sharded_snapshot_needs_sync_ranks(world_of_one, tmp_path):
    model = fsdp_model()
    guard = NanGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss, folder=tmp_path / "s")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert run(guard, model) is False
    assert guard.last_snapshot is None and "sync_ranks=True" in (guard.last_error or "")
    assert any("sync_ranks=True" in str(x.message) for x in w)


def test_one_rank_folder(world_of_one, tmp_path):
    model = fsdp_model()
    guard = NanGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss, folder=tmp_path / "s",
                     sync_ranks=True)
    assert run(guard, model) is False
    a = analyze(guard.last_snapshot, verify=False).to_json()
    assert a["verdict"] == "culprit_found" and a["culprit"]["op"] == "aten.sqrt.default" and a["culprit"]["rank"] == 0
    assert a["distributed"]["world_size"] == 1 and a["distributed"]["crossed"] is False


def test_sharded_false_keeps_one_file_per_rank(world_of_one, tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    guard = NanGuard(model, None, loss_fn=F.mse_loss, folder=tmp_path / "s", sync_ranks=True)
    x, y = torch.rand(5, 3), torch.randn(5, 1)
    x[0, 0] = float("nan")
    guard.begin(x, y, step=0)
    assert guard.loss_ok(F.mse_loss(model(x), y)) is False
    assert guard.last_snapshot.endswith(".pt")  # a replicated model writes a folder only with sharded=True
    folder_guard = NanGuard(model, None, loss_fn=F.mse_loss, folder=tmp_path / "f", sync_ranks=True, sharded=True)
    folder_guard.begin(x, y, step=0)
    assert folder_guard.loss_ok(F.mse_loss(model(x), y)) is False
    a = analyze(folder_guard.last_snapshot).to_json()
    assert a["verdict"] == "nonfinite_input" and a["distributed"]["strategy"] == "replicated"
