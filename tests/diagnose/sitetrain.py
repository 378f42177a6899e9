"""Training loops whose fix is an edit of the line that made the optimizer, the scheduler or the autocast context
(tests/diagnose/test_site_edits.py). `python sitetrain.py FOLDER KIND...` trains each under NanGuard until it breaks
and prints `KIND path-of-its-snapshot`; `python sitetrain.py --losses KIND...` trains each without the guard and
prints its losses and whether every step was finite."""

import argparse
import json
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS, BAD = 8, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        out = self.head(h)
        if x.shape[0] > 8:  # a larger batch also trains the auxiliary head, with a small weight
            out = out + 1e-3 * self.aux(h)
        return out


def batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    n = 16 if step >= BAD else 8
    return torch.randn(n, 4, generator=g).to(dtype), torch.randn(n, 1, generator=g).to(dtype)


class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x):
        return self.dec(torch.relu(self.enc(x)))


def ae_batch(step, dtype=torch.float32):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(400 + step)) * 3
    return x, x


def make_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=3.0), None


CONFIG = {"lr": 2.5, "steps": STEPS}  # the rate given by name (`lr=CONFIG["lr"]`), as training scripts do


def make_sgd_cfg(model):
    return torch.optim.SGD(model.parameters(), lr=CONFIG["lr"]), None


def make_sgd_args(model):
    ap = argparse.ArgumentParser()
    ap.add_argument("--learning-rate", type=float, default=2.0)  # the rate as a command-line option's default
    args, _ = ap.parse_known_args()
    return torch.optim.SGD(model.parameters(), lr=args.learning_rate), None


def make_spike(model):
    return torch.optim.SGD(model.parameters(), lr=0.02), None


def make_adam(model):
    model.half()
    return torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8), None


def make_sched(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(torch.tensor(BAD - s).float().rsqrt()))


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 64), nn.Linear(64, 1)

    def forward(self, x):
        h = self.body(x)
        att = (h @ h.transpose(-2, -1)).softmax(-1)  # float16 under autocast: scores past 65504 are inf
        return self.head(att @ h)


def mixer_batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 1, generator=g)
    return (x * 80 if step == BAD else x), y  # a batch of larger features


def autocast_run(folder=None):
    torch.manual_seed(0)
    model = Mixer()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = None
    if folder is not None:
        from nanreplay import NanGuard
        guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder)
    losses = []
    for step in range(STEPS):
        x, y = mixer_batch(step)
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        if guard and not guard.loss_ok(loss):
            return guard
        loss.backward()
        if guard and not guard.grads_ok():
            return guard
        opt.step()
    return {"losses": losses, "finite": all(math.isfinite(v) for v in losses)}


LOOPS = {"sgd": (AutoEncoder, make_sgd, ae_batch), "sgdcfg": (AutoEncoder, make_sgd_cfg, ae_batch),
         "spike": (AutoEncoder, make_spike, ae_batch), "sgdargs": (AutoEncoder, make_sgd_args, ae_batch),
         "adam": (Net, make_adam, batch), "sched": (Net, make_sched, batch)}


def run(kind, folder=None):
    if kind == "autocast":
        return autocast_run(folder)
    torch.manual_seed(0)
    make_model, make_opt, batch_of = LOOPS[kind]
    model = make_model()
    opt, sched = make_opt(model)
    dtype = next(model.parameters()).dtype
    guard = None
    if folder is not None:
        from nanreplay import NanGuard
        guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder, scheduler=sched)
    losses, finite = [], True
    for step in range(STEPS):
        x, y = batch_of(step, dtype)
        if kind == "spike" and step == BAD:  # the rate written in the loop, no scheduler: 10^6 too large
            for g in opt.param_groups:
                g["lr"] *= 10 ** 6
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        if guard and not guard.loss_ok(loss):
            return guard
        loss.backward()
        if guard and not guard.grads_ok():
            return guard
        opt.step()
        if sched is not None:
            sched.step()
        if guard and not guard.update_ok():
            return guard
        finite = finite and math.isfinite(loss.item()) and all(bool(torch.isfinite(p).all()) for p in model.parameters())
        if not finite:
            break
    return {"losses": losses, "finite": finite}


if __name__ == "__main__":
    if sys.argv[1] == "--losses":
        print(json.dumps({kind: run(kind) for kind in sys.argv[2:]}))
    else:
        import pathlib
        for kind in sys.argv[2:]:
            folder = pathlib.Path(sys.argv[1]) / kind
            run(kind, str(folder))
            print(kind, *sorted(folder.glob("*.pt"))[:1])
