"""Real training loops whose optimizer step breaks the weights, one per cause (CPU, a fraction of a second each).

Shared by tests/capture/test_update.py (what the guard writes) and tests/diagnose/test_optimizer.py (what the
analysis says). Each returns `Run(trigger, step, guard)`: which check fired, at which step, and the guard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard


@dataclass
class Run:
    trigger: str | None  # "loss" | "grads" | "update" | None (the loop finished)
    step: int | None
    guard: NanGuard


def mlp(dtype: torch.dtype = torch.float32, out: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, out)).to(dtype)


def train(model: nn.Module, opt: torch.optim.Optimizer, folder, *, steps: int = 8, dtype=torch.float32,
          loss_fn: Callable = F.cross_entropy, regression: bool = False, scheduler=None,
          before_step: Callable | None = None, stop: bool = True, **guard_kw) -> Run:
    """The loop from NanGuard's docstring: begin, loss_ok, backward, grads_ok, step, update_ok (+ scheduler)."""
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder, scheduler=scheduler, **guard_kw)
    g = torch.Generator().manual_seed(0)
    first = None
    for step in range(steps):
        x = torch.randn(64, 16, generator=g).to(dtype)
        y = (torch.randn(64, 1, generator=g) * 10).to(dtype) if regression else torch.randint(0, 4, (64,), generator=g)
        if before_step is not None:
            before_step(step, opt)
        guard.begin(x, y, step=step)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        if not guard.loss_ok(loss):
            first = first or Run("loss", step, guard)
            if stop:
                return first
            continue
        loss.backward()
        if not guard.grads_ok():
            first = first or Run("grads", step, guard)
            if stop:
                return first
            continue
        opt.step()
        if not guard.update_ok():
            first = first or Run("update", step, guard)
            if stop:
                return first
        if scheduler is not None:
            scheduler.step()
    return first or Run(None, None, guard)


def half_adam(folder, **kw) -> Run:
    """An MLP cast with .half(), Adam with its defaults: eps=1e-8 is 0 in float16, and where a gradient is tiny
    exp_avg_sq underflows to 0 — the first update divides by zero."""
    model = mlp(torch.float16)
    opt_kw = {k: kw.pop(k) for k in ("foreach", "fused") if k in kw}
    return train(model, torch.optim.Adam(model.parameters(), **opt_kw), folder, dtype=torch.float16, **kw)


def sum_mse(out, y):
    return F.mse_loss(out, y, reduction="sum")


def half_sgd_overflow(folder, **kw) -> Run:
    """float16 regression with a summed loss and lr=1e3 (meant: 1e-3): lr × gradient passes float16's 65504."""
    model = mlp(torch.float16, out=1)
    return train(model, torch.optim.SGD(model.parameters(), lr=1e3), folder, dtype=torch.float16, loss_fn=sum_mse,
                 regression=True, **kw)


def nan_momentum(folder, **kw) -> Run:
    """SGD with momentum resumes, at step 3, from a checkpoint whose momentum buffer holds NaN."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def resume(step, opt):
        if step == 3:
            sd = opt.state_dict()
            sd["state"][0]["momentum_buffer"][0, :3] = float("nan")
            opt.load_state_dict(sd)
    return train(model, opt, folder, before_step=resume, **kw)


def inf_schedule(folder, **kw) -> Run:
    """A LambdaLR whose warmup factor is computed with tensors and divides by zero at epoch 3: lr = inf."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(torch.tensor(1.0) / (3 - s)))
    return train(model, opt, folder, scheduler=sched, **kw)
