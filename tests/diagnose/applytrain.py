"""Training loops whose fix is an edit the user can apply: of more than one line, or of a line a rule used to leave
as advice (tests/diagnose/test_applied_edits.py). `python applytrain.py FOLDER KIND...` trains each under NanGuard
until it breaks and prints `KIND path-of-its-snapshot`; `python applytrain.py --losses KIND...` trains each without
the guard and prints their losses and whether every step was finite: what the test compares once the fixes' edits
are applied to a copy of this file."""

import json
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE = -100
STEPS, BAD = 5, 3


class MixtureDensity(nn.Module):
    def __init__(self, k=4):
        super().__init__()
        self.h = nn.Sequential(nn.Linear(3, 12), nn.Tanh())
        self.pi, self.mu, self.sigma = nn.Linear(12, k), nn.Linear(12, k), nn.Linear(12, k)

    def forward(self, x):
        h = self.h(x)
        return F.softmax(self.pi(h), -1), self.mu(h), F.softplus(self.sigma(h)) + 0.05


def mdn_loss(out, y):
    pi, mu, sigma = out
    z = (y - mu) / sigma
    dens = pi * torch.exp(-0.5 * z ** 2) / sigma
    nll = -torch.log(dens.sum(-1))  # CULPRIT: mdn
    return nll.mean()


def mdn_batch(step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, 1, generator=g)
    if step == BAD:
        y[2] = 60.0  # a target far from every component: every density underflows to 0
    return x, y


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.out = nn.Linear(6, 11)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def lm_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)  # CULPRIT: ce


def lm_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 11, (3, 4), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, :2] = IGNORE  # the prompt
    if step == BAD:
        labels[:] = IGNORE  # every answer truncated away
    return ids, labels


class HalfAttention(nn.Module):
    def __init__(self, d=8, n=6):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, 3)
        self.register_buffer("causal", torch.tril(torch.ones(n, n, dtype=torch.bool)))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        att = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5)  # CULPRIT: attn
        att = att.masked_fill(~self.causal, float("-inf"))
        w = att.softmax(-1)
        return self.head((w @ v).mean(1)).float()


def half_model():
    return HalfAttention().half()  # the code's own cast: no autocast


def attn_batch(step):
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(2, 6, 8, generator=g)
    if step == BAD:
        x[0] *= 300.0  # an unnormalised feature
    return x.half(), torch.randint(0, 3, (2,), generator=g)


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 1)

    def forward(self, x):
        return torch.sigmoid(self.fc2(torch.relu(self.fc1(x))))  # the model returns probabilities


def bce_on_probabilities(p, y):
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # CULPRIT: bce


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 1)

    def forward(self, x):
        return self.fc(x)


def bce_in_the_loss(z, y):
    p = torch.sigmoid(z.squeeze(-1))
    loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p))  # CULPRIT: bce_block
    return loss.mean()


def bce_batch(step):
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randn(6, 5, generator=g)
    y = (torch.rand(6, 1, generator=g) > 0.5).float()
    if step == BAD:
        x[1] *= 1e4  # a raw, unnormalised reading saturates the sigmoid: p is exactly 0 or 1, one log is log(0)
    return x, y


def bce_block_batch(step):
    x, y = bce_batch(step)
    return x, y.squeeze(-1)


class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x):
        return self.dec(torch.relu(self.enc(x)))


def ae_batch(step):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(400 + step)) * 3
    return x, x


LR_TOO_HIGH = 3.0  # the run's learning rate: training climbs from the first update (the test sets the one advised)

LOOPS = {"mdn": (MixtureDensity, mdn_loss, mdn_batch, 1e-2), "ce": (TinyLM, lm_loss, lm_batch, 1e-2),
         "attn": (half_model, F.cross_entropy, attn_batch, 1e-2),
         "bce": (Scorer, bce_on_probabilities, bce_batch, 1e-2),
         "bce_block": (Logits, bce_in_the_loss, bce_block_batch, 1e-2),
         "lr": (AutoEncoder, F.mse_loss, ae_batch, LR_TOO_HIGH)}


def run(kind, folder=None):
    make, loss_fn, batch, lr = LOOPS[kind]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    guard = None
    if folder is not None:
        from nanreplay import NanGuard
        guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder)
    losses, finite = [], True
    for step in range(STEPS):
        x, y = batch(step)
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        losses.append(loss.item())
        if guard and not guard.loss_ok(loss):
            return guard
        loss.backward()
        grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        if guard and not guard.grads_ok():
            return guard
        finite = finite and math.isfinite(loss.item()) and grads_ok
        if not finite:
            break
        opt.step()
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
