"""NanGuard's choices for sharded models, in this process (a world of one rank): a folder, rank agreement on by
itself (refused off at construction), `sharded=` to choose, and a one-rank folder analyzes like any other."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.analysis import analyze
from nanreplay.errors import GuardError


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


def test_a_sharded_model_agrees_across_ranks_without_the_flag(world_of_one, tmp_path):
    model = fsdp_model()
    guard = NanGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss, folder=tmp_path / "s")
    assert guard.sync_ranks is True  # on by itself: the folder needs every rank at the same step
    assert run(guard, model) is False
    assert guard.last_snapshot is not None and guard.last_error is None
    a = analyze(guard.last_snapshot, verify=False).to_json()
    assert a["verdict"] == "culprit_found" and a["culprit"]["op"] == "aten.sqrt.default"


def test_turning_rank_agreement_off_on_a_sharded_model_fails_at_construction(world_of_one, tmp_path):
    model = fsdp_model()
    with pytest.raises(GuardError, match=r"sync_ranks=False\) on a sharded model") as e:
        NanGuard(model, None, loss_fn=F.mse_loss, folder=tmp_path / "s", sync_ranks=False)
    assert "\n" not in str(e.value)
    replicated = nn.Sequential(nn.Linear(3, 4))
    assert NanGuard(replicated, None, loss_fn=F.mse_loss, folder=tmp_path / "r").sync_ranks is False
    assert NanGuard(replicated, None, loss_fn=F.mse_loss, folder=tmp_path / "r", sharded=True).sync_ranks is True


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
