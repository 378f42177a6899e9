"""Families the real-bug benchmark's second batch of cases exposed (benchmarks/realbugs/results.md), each on a
training loop analyzed where the training code cannot be imported, each fix judged by applying it
(isolation.apply_and_train): the shown edit put into a copy of the training file and trained on.

* nn.MultiheadAttention given a key_padding_mask whose row is all True (pytorch/pytorch#40932): torch makes the
  -inf itself, so the edit is the user's call, passing the mask as a float mask of finfo.min;
* a Gaussian policy whose std = exp(log_std) underflows to 0 (leggedrobotics/rsl_rl#190): the log(0) is inside
  torch.distributions; the exponent is bounded where the user takes the exp;
* label smoothing over logits masked with -inf (facebookresearch/pytext#1698): the smoothing spread over the
  allowed classes, on the loss's line;
* NT-Xent written with exps (Lightning-Universe/lightning-bolts#320): -log(pos / neg) becomes a - logsumexp(S);
* torch.linalg.eigh at a repeated eigenvalue (pytorch/pytorch#47599): recorded as a step program, localised to
  the eigh line, explained (advice: no line change is exact).
"""

from __future__ import annotations

import pytest
from isolation import ROOT, apply_and_train, marker_line, train_and_analyze_isolated

TRAINING = r'''
import json
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Normal
from nanreplay import NanGuard


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 2)

    def forward(self, tokens):
        h = self.emb(tokens)
        pad = tokens == 0
        h, _ = self.attn(h, h, h, key_padding_mask=pad)  # LINE: mha
        return self.out(h.mean(1))


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.mu = nn.Linear(3, 2)
        self.log_std = nn.Linear(3, 2)

    def forward(self, obs, actions):
        std = torch.exp(self.log_std(obs))  # LINE: std
        return Normal(self.mu(obs), std, validate_args=False).log_prob(actions).sum(-1)  # LINE: logprob


def policy_loss(logp, adv):
    return -(logp * adv).mean()


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 5)

    def forward(self, x, allowed):
        return self.net(x).masked_fill(~allowed, float("-inf"))  # LINE: mask


def smoothed(logits, y):
    return F.cross_entropy(logits, y, label_smoothing=0.1)  # LINE: smooth


class Projector(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 4)

    def forward(self, v1, v2):
        return self.net(v1), self.net(v2)


def nt_xent(z, _):
    sim = z[0] @ z[1].t() / 0.5
    pos = torch.exp(sim.diagonal())  # LINE: pos
    neg = torch.exp(sim).sum(-1)
    return -torch.log(pos / neg).mean()  # LINE: ntxent


class Ring(nn.Module):  # a learned graph: edge weights from edge features
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, feats):
        w = F.softplus(self.lin(feats)).squeeze(-1)
        src, dst = torch.tensor([0, 1, 2, 3, 4, 0, 1]), torch.tensor([1, 2, 3, 4, 5, 5, 3])
        W = torch.zeros(6, 6).index_put((src, dst), w).index_put((dst, src), w, accumulate=True)
        return torch.diag(W.sum(1)) - W


def fiedler(lap, t):
    evals, evecs = torch.linalg.eigh(lap)  # LINE: eigh
    return (evecs[:, 1] ** 2 * t).sum() + evals[1]


def batches(kind, step, model):
    g = torch.Generator().manual_seed(step)
    if kind == "mha":
        tokens = torch.randint(1, 9, (3, 5), generator=g)
        tokens[:, 4:] = 0
        if step == 2:
            tokens[1] = 0  # a sequence that is all padding
        return (tokens,), torch.randint(0, 2, (3,), generator=g)
    if kind == "policy":
        obs = torch.randn(4, 3, generator=g)
        if step == 2:
            obs[1] = -400.0 * model.log_std.weight.sum(0).sign()  # a glitch that drives log_std far below -104
        return (obs, torch.randn(4, 2, generator=g)), torch.randn(4, generator=g)
    if kind == "smooth":
        allowed = torch.ones(4, 5, dtype=torch.bool)
        if step == 2:
            allowed[:, 3:] = False  # a task with fewer labels: two classes masked
        return (torch.randn(4, 4, generator=g), allowed), torch.randint(0, 3, (4,), generator=g)
    if kind == "ntxent":
        x = torch.randn(4, 6, generator=g)
        v1, v2 = x + 0.1 * torch.randn(4, 6, generator=g), x + 0.1 * torch.randn(4, 6, generator=g)
        if step == 2:
            v1[2] *= 40.0  # a loud sample: unnormalised projections overflow exp
            v2[2] *= 40.0
        return (v1, v2), torch.zeros(4)
    feats = torch.randn(7, 4, generator=g)
    if step == 2:
        with torch.no_grad():  # every edge of nodes 4 and 5 pruned (softplus is 0): the eigenvalue 0 repeats exactly
            feats[3:6] = -300.0 * model.lin.weight[0].sign()
    return (feats,), torch.arange(6.0)


MODELS = {"mha": (Encoder, F.cross_entropy), "policy": (Actor, policy_loss), "smooth": (Tagger, smoothed),
          "ntxent": (Projector, nt_xent), "eigh": (Ring, fiedler)}


def run(kind, folder=None):
    """Four optimizer steps; with a folder, under NanGuard (stops at the failure); else plainly: (loss, grad norm)."""
    torch.manual_seed(0)
    cls, loss_fn = MODELS[kind]
    model = cls()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder) if folder else None
    out = []
    for step in range(4):
        x, y = batches(kind, step, model)
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = loss_fn(model(*x), y)
        if guard:
            if not guard.step(loss):
                return guard.last_snapshot
            continue
        loss.backward()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
        out.append((loss.item(), norm.item()))
        opt.step()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--plain":
        print(json.dumps({k: run(k) for k in sys.argv[2:]}))
    else:
        for kind in sys.argv[2:]:
            print(kind, run(kind, f"{sys.argv[1]}/{kind}"))
'''

pytestmark = pytest.mark.integrations  # training loops run and analyzed in subprocesses, as test_real_bugs.py

KINDS = ("mha", "policy", "smooth", "ntxent", "eigh")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("newfamilies")
    return root, train_and_analyze_isolated(root, "newfamilies", TRAINING, KINDS, ENV)


def _applied(root, kind: str, fix: dict) -> None:
    apply_and_train(root / f"fixed_{kind}", TRAINING, "newfamilies", kind, fix, bad=2, env=ENV)


def test_mha_all_padding_row_gets_a_finite_float_mask_on_the_users_call(runs):
    root, out = runs
    d = out["mha"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "mha")
    diag = d["diagnosis"]
    assert diag["cause"] == "softmax_all_masked", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["verified"] is True, fix["verification"]
    assert fix["after"].startswith("h, _ = self.attn(h, h, h, key_padding_mask=torch.zeros_like(pad, dtype=h.dtype)"
                                   ".masked_fill(pad, torch.finfo(h.dtype).min))"), fix
    _applied(root, "mha", fix)


def test_policy_std_underflow_is_bounded_where_the_exp_is_taken(runs):
    root, out = runs
    d = out["policy"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "logprob")  # log(scale), inside Normal.log_prob
    diag = d["diagnosis"]
    assert diag["cause"] == "exp_underflow", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["after"].startswith("std = torch.exp(self.log_std(obs).clamp(min="), fix
    assert f"newfamilies.py:{marker_line(TRAINING, 'std')}" in diag["explanation"]
    _applied(root, "policy", fix)


def test_label_smoothing_over_masked_logits_is_spread_over_the_allowed_classes(runs):
    root, out = runs
    d = out["smooth"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "mask")  # a literal-only chain: the mask's line
    diag = d["diagnosis"]
    assert diag["cause"] == "label_smoothing_masked", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["edits"] and fix["edits"][0]["line"] == marker_line(TRAINING, "smooth"), fix
    assert "torch.isfinite(logits).sum(1)" in fix["after"] and "label_smoothing" not in fix["after"], fix
    _applied(root, "smooth", fix)


def test_nt_xent_with_exps_becomes_a_logsumexp_on_the_log_line(runs):
    root, out = runs
    d = out["ntxent"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "pos")
    diag = d["diagnosis"]
    assert diag["cause"] == "log_ratio_of_exps", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["kind"] == "log_softmax" and fix["verified"] is True, fix["verification"]
    assert fix["after"].startswith("return -(sim.diagonal() - torch.logsumexp(sim, -1)).mean()"), fix
    _applied(root, "ntxent", fix)


def test_eigh_at_a_repeated_eigenvalue_is_recorded_localised_and_explained(runs):
    _, out = runs
    d = out["eigh"]
    assert d["culprit"]["forward_op"].startswith("aten._linalg_eigh")
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "eigh")
    diag = d["diagnosis"]
    assert diag["cause"] == "eigh_degenerate", (diag["cause"], diag["title"])
    assert diag["fix"]["kind"] == "eigenspace" and not diag["fix"]["edits"]  # advice: no exact line change
