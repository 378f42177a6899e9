"""DDP with `ZeroRedundancyOptimizer` on gloo (the open-world audit, round 4: docs/recordable-ops.md).

* ZeRO gives its state dict only after `consolidate_state_dict()`, a collective every rank must join: the guard's
  `optimizer.state_dict()` raised, and the failure cost the whole snapshot (one warning, no file, on every rank).
  The snapshot now records the optimizer ZeRO runs on this rank's shard (`.optim`), and an optimizer whose state
  will not come costs only that field.
* Under `sync_ranks=True` every rank writes a snapshot of the failing step. The healthy rank's was analyzed as "a
  transient fault of the machine" (its re-run was finite: so was its training step). It now says which rank failed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from isolation import ROOT, marker_line

from nanreplay import NanGuard
from nanreplay.analysis import analyze

TRAINING = r'''
import os, sys
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from nanreplay import NanGuard


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        x = x / x.norm(dim=-1, keepdim=True)  # LINE: ddp
        return self.b(torch.relu(self.a(x)))


def run(folder, guarded, bad, rank):
    torch.manual_seed(0)
    model = DDP(Net())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=folder, sync_ranks=True) if guarded else None
    g = torch.Generator().manual_seed(1 + rank)
    rows = []
    for step in range(4):
        x, y = torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)
        if step == bad and rank == 1:
            x[2] = 0  # an all-zero sample on rank 1 only
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if guard and not guard.loss_ok(loss):
            break
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard and not guard.grads_ok(norm, clip=1.0):
            break
        opt.step()
        rows.append((loss.item(), norm.item()))
    return rows, model, guard


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), sys.argv[1]
    r0, m0, _ = run(f"{out}/off", False, None, rank)
    r1, m1, g1 = run(f"{out}/on", True, None, rank)
    same = len(r0) == 4 and r0 == r1 and g1.last_snapshot is None and \
        all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters()))
    _, _, g = run(f"{out}/bad", True, 2, rank)
    print("RESULT", rank, "same" if same else "differs", g.last_snapshot, flush=True)
    dist.destroy_process_group()
'''


def test_ddp_with_zero_writes_a_snapshot_per_rank_and_the_healthy_rank_names_the_failing_one(tmp_path):
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    (tmp_path / "zerotrain.py").write_text(TRAINING)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "--max-restarts=0", "zerotrain.py", str(tmp_path)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = {int(r): (same, path) for _, r, same, path in
               (ln.split() for ln in res.stdout.splitlines() if ln.startswith("RESULT "))}
    assert set(results) == {0, 1} and all(s == "same" for s, _ in results.values()), res.stdout
    assert all(p.endswith(".pt") for _, p in results.values()), res.stdout + res.stderr[-2000:]
    os.remove(tmp_path / "zerotrain.py")  # the training code is not importable where the snapshots are analyzed
    snap = torch.load(results[1][1], weights_only=True)
    assert snap["nonfinite_ranks"] == [1] and snap["optimizer"]["class"] == "AdamW"
    assert snap["optimizer"]["state_dict"]["state"], snap["optimizer"]  # this rank's shard: Adam's moments
    failing = analyze(results[1][1]).to_json()
    assert failing["verdict"] == "culprit_found" and failing["culprit"]["forward_op"] == "aten.div.Tensor"
    assert failing["culprit"]["source"]["line"] == marker_line(TRAINING, "ddp")
    assert failing["diagnosis"]["fix"]["verified"] is True
    healthy = analyze(results[0][1]).to_json()
    assert healthy["diagnosis"]["cause"] == "failed_on_another_rank", healthy["diagnosis"]
    assert "rank 1" in healthy["diagnosis"]["title"] and "transient" not in healthy["diagnosis"]["explanation"].lower()
    assert healthy["differential"]["machine"]["verdict"] == "skipped"


def test_an_optimizer_whose_state_will_not_come_costs_that_field_only(tmp_path):
    """Any optimizer whose state_dict() raises (a wrapper that needs a collective, a library's own): the snapshot is
    still written, with the optimizer's class and no state."""

    class Stubborn(torch.optim.SGD):
        def state_dict(self):
            raise RuntimeError("needs every rank")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = Stubborn(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=tmp_path)
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    x[1, 0] = float("nan")
    guard.begin(x, y, step=0)
    assert not guard.loss_ok(F.cross_entropy(model(x), y))
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap["optimizer"]["class"] == "Stubborn" and snap["optimizer"]["state_dict"] is None
    assert snap["optimizer"]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
