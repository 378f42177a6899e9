"""Training runs for the sharded-snapshot tests: a small FSDP2 model on 2 gloo ranks, one run per scenario.

    python -m torch.distributed.run --standalone --nproc-per-node 2 fsdp_steps.py OUT a b c d

Each scenario trains the same model (FSDP2 units: `dist`, `blocks.0`, `blocks.1`, and the root) under
`NanGuard` — no `sync_ranks=` flag: a sharded model agrees across ranks by itself — until step 2 goes non-finite,
and writes one sharded snapshot folder to OUT/<s>:

  a  a rank-local bad batch: rank 1's batch has a 0 in the feature the model takes the log of
  b  a culprit op in a sharded layer: blocks.1's bias is pushed negative (as by a bad update) under a sqrt,
     on every rank
  c  a NaN that reaches the other rank only through the gradient reduce: rank 0's batch has a row that
     makes `dist`'s distance exactly 0; the loss stays finite, sqrt's backward makes NaN on rank 0 only
  d  a NaN in rank 1's batch itself
  r  as c, with DDP instead of FSDP2 (`NanGuard(..., sharded=True)`): the NaN crosses in the all-reduce
  w  weights already non-finite: a NaN lands in rank 1's shard of blocks.0.fc2.weight before step 2
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from nanreplay import NanGuard

D = 8


class Dist(nn.Module):
    """The distance between two projections of the input features."""

    def __init__(self):
        super().__init__()
        self.fa = nn.Linear(3, 4, bias=False)
        self.fb = nn.Linear(3, 4, bias=False)

    def forward(self, x):
        return ((self.fa(x) - self.fb(x)) ** 2).sum(-1, keepdim=True).sqrt()  # CULPRIT (c): backward at distance 0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        with torch.no_grad():
            self.fc1.bias.fill_(10.0)

    def forward(self, x):
        return x + self.fc2(torch.sqrt(self.fc1(self.norm(x))))  # CULPRIT (b): negative under the sqrt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.dist = Dist()
        self.inp = nn.Linear(5, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        feats = torch.cat([torch.log(x[:, :1]), x[:, 1:], self.dist(x[:, 1:])], -1)  # CULPRIT (a): log(0)
        h = self.inp(feats)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def batch(rank, step, scenario, g):
    x = torch.rand(6, 4, generator=g) + 0.5
    y = torch.randn(6, 1, generator=g)
    if step == 2:
        if scenario == "a" and rank == 1:
            x[3, 0] = 0.0
        if scenario in "cr" and rank == 0:
            x[2, 1:] = 0.0
        if scenario == "d" and rank == 1:
            x[1, 2] = float("nan")
    return x, y


def train(scenario, out, rank):
    torch.manual_seed(0)
    model = Net()
    if scenario == "r":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        for unit in (model.dist, *model.blocks):
            fully_shard(unit)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=f"{out}/{scenario}",
                     sharded=True if scenario == "r" else None)  # no sync_ranks=: on by itself for sharded models
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        x, y = batch(rank, step, scenario, g)
        if scenario == "b" and step == 2:
            with torch.no_grad():
                model.blocks[1].fc1.bias.fill_(-100.0)
        if scenario == "w" and step == 2 and rank == 1:
            with torch.no_grad():
                model.blocks[0].fc2.weight.to_local()[-1, 0] = float("nan")  # the last row: rank 1's shard
        guard.begin(x, y, step=step)
        if not guard.step(F.mse_loss(model(x), y)):
            break
    return step, guard.last_snapshot, guard.last_error


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    lines = []
    for s in sys.argv[2:]:
        step, path, error = train(s, sys.argv[1], rank)
        lines.append(f"RESULT {s} {rank} {step} {path} {error}\n")
    with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as f:  # (the ranks share one stdout: lines would interleave)
        f.writelines(lines)
    dist.barrier()  # gloo aborts a process that tears down while its peer is still connected
    dist.destroy_process_group()
