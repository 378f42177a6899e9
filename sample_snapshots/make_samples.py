"""Regenerate the sample snapshots, deterministically: `python sample_snapshots/make_samples.py`.

One snapshot per cause in the seed document's catalogue, in the seed's own
"cheap NaN insurance" format: {'x': ..., 'y': ..., 'state': model.state_dict()}.
Analyze one with, e.g.:

    nanreplay analyze sample_snapshots/sqrt_zero.pt --model sample_snapshots.models:triplet
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from sample_snapshots import models  # noqa: E402

# name -> (factory, loss spec or None, builder of the seed dict's batch given the model)
SAMPLES = {}


def sample(name: str, factory: str, loss: str | None):
    def deco(fn):
        SAMPLES[name] = (factory, loss, fn)
        return fn
    return deco


@sample("sqrt_zero", "triplet", None)
def _(m):
    a = torch.randn(8, 16)
    p = a + 0.1 * torch.randn(8, 16)
    p[5] = a[5]  # a duplicated pair: distance exactly 0
    return {"x": (a, p)}


@sample("log_zero", "poisson", None)
def _(m):
    return {"x": (torch.randn(16, 8), torch.poisson(torch.full((16,), 3.0)))}


@sample("sqrt_negative", "std_scaler", "mse_loss")
def _(m):
    return {"x": torch.randn(16, 8), "y": torch.randn(16)}


@sample("zero_norm", "retriever", "cross_entropy")
def _(m):
    q = torch.randn(8, 12)
    q[3] = 0.0  # an empty query
    return {"x": q, "y": torch.randint(0, 10, (8,))}


@sample("zero_log_zero", "entropy_gate", None)
def _(m):
    return {"x": torch.randn(16, 10)}


@sample("log_softmax", "overconfident", "nll_loss")
def _(m):
    with torch.no_grad():
        m.net[2].weight.mul_(400)  # what many steps of an aggressive LR do to the logits
    x = torch.randn(16, 20)
    with torch.no_grad():
        y = m(x).argmax(-1)
    return {"x": x, "y": y}


@sample("fp16_overflow", "half_mlp", "mse_loss")
def _(m):
    with torch.no_grad():
        m.fc2.weight.mul_(2000)  # weights that grew during fp16 training
    return {"x": (torch.randn(8, 32) * 80).half(), "y": torch.zeros(8).half()}


def main() -> None:
    for name, (factory, loss, build) in SAMPLES.items():
        torch.manual_seed(0)
        model = getattr(models, factory)()
        batch = build(model)
        torch.save({**batch, "state": model.state_dict()}, HERE / f"{name}.pt")
        flags = f"--model sample_snapshots.models:{factory}" + (f" --loss {loss}" if loss else "")
        print(f"nanreplay analyze sample_snapshots/{name}.pt {flags}")


if __name__ == "__main__":
    main()
