"""Training loops whose guard writes the re-run record (tests/capture/test_machine.py, tests/triage/test_machines.py).

`flip(module)` is a forward hook that, when armed, flips the top exponent bit of one activation in [1, 2) — which
turns it into NaN — on one forward only: the training step's. The guard's re-run of that step is then clean, as a
transient fault of the machine would leave it. `train()` runs a small classifier under NanGuard until it writes a
snapshot.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard

TOP_EXPONENT_BIT = 1 << 30  # float32: bit 30 is the exponent's highest; [1, 2) has exponent 127 -> 255 (NaN/Inf)


class Flip:
    """Armed for one call: flips one activation's top exponent bit in the forward (or its gradient, `grad=True`)."""

    def __init__(self, grad: bool = False):
        self.armed, self.grad, self.flipped = False, grad, 0

    def __call__(self, module, args, out):
        if not self.armed:
            return None
        self.armed = False
        if self.grad:
            out.register_hook(self._flip)
            return None
        return out + (self._flip(out.detach()) - out.detach())  # the flipped value, gradients as before

    def _flip(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        flat = t.view(-1)
        ones = ((flat.abs() >= 1) & (flat.abs() < 2)).nonzero()
        if len(ones):  # one bit: exponent 127 -> 255
            flat.view(torch.int32)[int(ones[0])] ^= TOP_EXPONENT_BIT
        else:  # (small gradients) every exponent bit of the largest entry set: NaN or Inf
            flat.view(torch.int32)[int(flat.abs().argmax())] |= 0x7F800000
        self.flipped += 1
        return t


class Net(nn.Module):
    def __init__(self, log: bool = False):
        super().__init__()
        self.a, self.b, self.log = nn.Linear(8, 32), nn.Linear(32, 3), log

    def forward(self, x):
        h = torch.relu(self.a(x)) * 4  # activations of a few units: some in [1, 2)
        if self.log:  # a genuine NaN: log of a ReLU's zeros (-inf) minus itself
            h = torch.log(h) - torch.log(h)
        return self.b(h)


class OwnGeneratorDropout(nn.Module):
    """Dropout drawn from the module's own torch.Generator, which the guard does not record."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.p, self.gen = p, torch.Generator().manual_seed(1234)

    def forward(self, x):
        keep = torch.empty_like(x).bernoulli_(1 - self.p, generator=self.gen)
        return x * keep / (1 - self.p)


class DropoutNet(Net):
    def __init__(self):
        super().__init__()
        self.drop = OwnGeneratorDropout()

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x)) * 4))


def dropout_net() -> nn.Module:  # --model machines:dropout_net
    torch.manual_seed(0)
    return DropoutNet()


def train(folder: Path, *, identity: dict | None = None, flip_at: int | None = None, grad_flip: bool = False,
          model: nn.Module | None = None, steps: int = 6, seed: int = 0) -> tuple[str | None, Flip]:
    """A few steps of a guarded loop; the snapshot's path (None: no failure) and the hook."""
    torch.manual_seed(seed)
    model = model or Net()
    hook = Flip(grad=grad_flip)
    model.a.register_forward_hook(hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = NanGuard(model, opt, F.cross_entropy, folder=folder, identity=identity)
    for step in range(steps):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        guard.begin(x, y, step=step)
        opt.zero_grad()
        hook.armed = step == flip_at
        loss = F.cross_entropy(model(x), y)
        if not guard.loss_ok(loss):
            break
        loss.backward()
        if not guard.grads_ok():
            break
        opt.step()
    guard.close()
    return guard.last_snapshot, hook
