"""A compiled step whose numerics differ from eager, and the backend that perturbs one op (sequential sums).

The model: `act` saturates to ±3e38 (a sigmoid at 1.0 times a large scale, half the features negative), `pool`
sums the 64 features. The exact sum is 0. Eager torch sums a row in several vector accumulators, each starting
from one +3e38 and then adding one -3e38: finite. A sum that adds the features in another order overflows float32
as soon as two +3e38 meet: inductor on this machine's CPU does (its lanes pair x[j] with x[j + 16]); the test
backend `sequential_sums` does on every CPU (it sums left to right, one addition at a time), which is what makes
the fast tests independent of the CPU's vector width.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard

A = 3e38
WIDTH = 64


class Act(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("sign", torch.tensor([1.0] * (WIDTH // 2) + [-1.0] * (WIDTH // 2)))

    def forward(self, h):
        return torch.sigmoid(h) * A * self.sign  # CULPRIT: saturated: ±3e38


class Pool(nn.Module):
    def forward(self, h):
        return h.sum(-1, keepdim=True)  # the reduction whose order decides overflow


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, WIDTH)
        self.act = Act()
        self.pool = Pool()
        self.head = nn.Linear(1, 1)
        with torch.no_grad():
            self.enc.weight.zero_()
            self.enc.bias.fill_(30.0)  # sigmoid(30 + small) is 1.0 in float32

    def forward(self, x):
        return self.head(self.pool(self.act(self.enc(x))))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 4, generator=g) * 0.01, torch.zeros(4, 1)


def _seq_sum(x, dim=None, keepdim=False, *, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    dims = [dim] if isinstance(dim, int) else list(dim) if dim else list(range(x.dim()))
    for d in sorted((d % x.dim() for d in dims), reverse=True):
        acc = x.select(d, 0)
        for i in range(1, x.shape[d]):  # left to right in x's dtype (torch's CPU cumsum accumulates in float64)
            acc = acc + x.select(d, i)
        x = acc.unsqueeze(d) if keepdim else acc
    return x


_SUMS = {torch.sum, torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default}


def sequential_sums(gm: torch.fx.GraphModule, example_inputs):
    """A torch.compile backend: the captured graph as it is, except that every sum adds left to right."""
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target in _SUMS) or (node.op == "call_method" and node.target == "sum"):
            if node.op == "call_method":
                node.op = "call_function"
            node.target = _seq_sum
    gm.recompile()
    return gm.forward


def train_snapshot(folder, *, backend=None, steps: int = 3) -> str | None:
    """Train `Net` compiled (with `backend`, default inductor) under NanGuard; the snapshot of its first non-finite
    loss (None: the compiled step stayed finite)."""
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend=backend or "inductor", dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    guard = NanGuard(compiled, opt, loss_fn=F.mse_loss, folder=folder)
    for step in range(steps):
        x, y = batch(step)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(compiled(x), y)
        if not guard.loss_ok(loss):
            break
        loss.backward()
        if not guard.grads_ok():
            break
        opt.step()
    torch.compiler.reset()
    return guard.last_snapshot
