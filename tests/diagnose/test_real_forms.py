"""Exact forms and root fixes on training loops analyzed where the training code cannot be imported, each fix
then judged by applying it: the shown line put into a copy of the training file, the loop trained again — no
NaN at the step that failed or after it, and the healthy steps before it unchanged.

* a mixture-density loss whose sample lies far from every component: each component's density underflows to
  0, log(0) = -inf; the exact form is logsumexp of the log-densities (an ε would cap the loss and cut its
  gradient);
* a graph attention layer's softmax over each target node's edges (a segment softmax, summed with
  scatter_add), whose scores overflow exp: the maximum is subtracted per segment, as torch_geometric does;
* a mixture-of-experts auxiliary loss that divides two sums by the same token count on consecutive lines, in a
  batch that is all padding: the count is clamped where it is made, so both divisions are fixed;
* a two-layer attention whose additive mask is built once from the padding and used by every layer, in a batch
  with a sequence that is all padding: the mask value is made finite where the mask is built;
* log(1 - exp(-rate)) under bfloat16 autocast with a rate below bfloat16's resolution next to 1: exp rounds to
  1, log1p(-1) = -inf; the exact form is log(-expm1(-rate)).
"""

from __future__ import annotations

import pytest
from isolation import ROOT, apply_and_train, marker_line, train_and_analyze_isolated

TRAINING = r'''
import json
import sys
import torch
import torch.nn as nn
from nanreplay import NanGuard


class MDN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 9)

    def forward(self, x):
        pi, mu, ls = self.net(x).split(3, -1)
        return pi.softmax(-1), mu, ls.exp()


def mdn_loss(out, y):
    pi, mu, sigma = out
    dens = pi * torch.exp(-0.5 * ((y - mu) / sigma) ** 2) / sigma  # LINE: densities
    return -torch.log(dens.sum(-1)).mean()  # LINE: mdn log


class GAT(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.att = nn.Parameter(torch.ones(8))

    def forward(self, x, src, dst):
        h = self.lin(x)
        a = torch.cat([h[src], h[dst]], -1) @ self.att
        e = torch.exp(a)  # LINE: edge exp
        den = torch.zeros(x.shape[0]).scatter_add(0, dst, e)
        alpha = e / den[dst]
        return torch.zeros_like(h).index_add(0, dst, alpha[:, None] * h[src]).pow(2).mean()


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 3)

    def forward(self, x, keep):
        probs = self.router(x).softmax(-1)
        onehot = nn.functional.one_hot(probs.argmax(-1), 3).float()
        n = keep.sum()  # LINE: count
        f = (onehot * keep[:, None]).sum(0) / n  # LINE: first use
        p = (probs * keep[:, None]).sum(0) / n
        return 3 * (f * p).sum()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(4, 8)
        self.v = nn.Linear(4, 4)

    def forward(self, h, mask):
        q, k = self.qk(h).chunk(2, -1)
        s = q @ k.transpose(-1, -2) + mask[:, None, :]
        return h + s.softmax(-1) @ self.v(h)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x, pad):
        mask = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))  # LINE: mask
        for b in self.blocks:
            x = b(x, mask)
        return x.pow(2).mean()


class Survival(nn.Module):  # log P(T > t) = log(1 - exp(-rate)), computed under bfloat16 autocast
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2, bias=False)

    def forward(self, x):
        rate = self.fc(x).pow(2).sum(-1) + 1e-4
        return -torch.log1p(-torch.exp(-rate)).mean()  # LINE: survival


def batches(kind, step):
    g = torch.Generator().manual_seed(step)
    if kind == "mdn":
        x, y = torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)
        if step == 2:
            y[1] = 1e3  # an outlier far from every component
        return (x,), y
    if kind == "gat":
        x = torch.randn(4, 4, generator=g)
        if step == 2:
            x[0] = -200.0  # one node's scores overflow exp
        return (x, torch.tensor([0, 1, 2, 3, 1]), torch.tensor([1, 2, 3, 0, 0])), None
    if kind == "bf16":  # a sample with no signal: a rate of 1e-4, below bfloat16's resolution next to 1
        x = torch.randn(4, 4, generator=g) + 2
        if step == 2:
            x[1] = 0.0
        return (x,), None
    if kind == "moe":
        keep = torch.ones(6)
        if step == 2:
            keep.zero_()  # a batch that is all padding
        return (torch.randn(6, 4, generator=g), keep), None
    pad = torch.zeros(2, 3, dtype=torch.bool)
    if step == 2:
        pad[1] = True  # a sequence that is all padding
    return (torch.randn(2, 3, 4, generator=g), pad), None


MODELS = {"mdn": MDN, "gat": GAT, "moe": MoE, "attention": Encoder, "bf16": Survival}


def run(kind, folder=None, f64=False):
    """Four SGD steps; with a folder, under NanGuard (stops at the failure); else plainly: (loss, grad norm);
    `f64`: in float64, without autocast (the reference)."""
    torch.manual_seed(0)
    model = MODELS[kind]().to(torch.float64 if f64 else torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = mdn_loss if kind == "mdn" else None
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder) if folder else None
    out = []
    for step in range(4):
        x, y = batches(kind, step)
        if f64:
            x = tuple(t.double() if t.is_floating_point() else t for t in x)
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16" and not f64):
            pred = model(*x)
        loss = loss_fn(pred, y) if loss_fn else pred
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
    if sys.argv[1] in ("--plain", "--f64"):
        print(json.dumps({k: run(k, f64=sys.argv[1] == "--f64") for k in sys.argv[2:]}))
    else:
        for kind in sys.argv[2:]:
            print(kind, run(kind, f"{sys.argv[1]}/{kind}"))
'''

pytestmark = pytest.mark.integrations  # training loops run and analyzed in subprocesses, as test_real_code.py

KINDS = ("mdn", "gat", "moe", "attention", "bf16")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("realforms")
    return root, train_and_analyze_isolated(root, "realforms", TRAINING, KINDS, ENV)


def _apply_and_train(root, kind: str, fix: dict, coarse: bool = False) -> None:
    """The fix applied to a copy of the training file and trained on (isolation.apply_and_train): finite at every
    step, the step that failed (2) included, the healthy steps before it unchanged."""
    apply_and_train(root / f"fixed_{kind}", TRAINING, "realforms", kind, fix, bad=2, env=ENV, coarse=coarse)


def test_mixture_density_loss_gets_logsumexp_not_an_epsilon(runs):
    root, out = runs
    d = out["mdn"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "mdn log")
    diag = d["diagnosis"]
    assert diag["cause"] == "logsumexp_underflow", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert diag["candidates"][0]["kind"] == fix["kind"] == "max_subtraction" and fix["epsilon"] is None
    assert fix["verified"] is True, fix["verification"]
    # the densities are made on the line above: that line makes their log instead, and the log of their sum is a
    # logsumexp of it — two edits, replayed as written (applied and trained on in test_applied_edits.py: here the
    # outlier, y = 1e3, keeps its exact gradient of ~1e5, and the next update overflows this loop's sigma = exp(ls))
    made, log = fix["edits"]
    assert fix["tested_as"] == "line" and made["line"] == marker_line(TRAINING, "densities")
    assert made["after"].startswith("log_dens = ") and "torch.exp" not in made["after"]
    assert log["line"] == marker_line(TRAINING, "mdn log") and "torch.logsumexp(log_dens, -1)" in log["after"]
    assert "cap that sample's loss" in diag["explanation"]


def test_segment_softmax_of_a_graph_layer_subtracts_each_segments_max(runs):
    root, out = runs
    d = out["gat"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "edge exp")
    diag = d["diagnosis"]
    assert diag["cause"] == "segment_softmax", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["kind"] == "max_subtraction" and fix["verified"] is True, fix["verification"]
    assert "scatter_reduce(0, index, x.detach(), 'amax')" in fix["code"] and "realforms.py:" in fix["code"]
    # by hand, as the guidance says (num_segments = the node count, index = dst)
    fix = dict(fix, before="e = torch.exp(a)", after="e = torch.exp(a - torch.full((x.shape[0],), float('-inf'))"
               ".scatter_reduce(0, dst, a.detach(), 'amax')[dst])")
    _apply_and_train(root, "gat", fix)


def test_moe_shared_zero_count_is_clamped_where_it_is_made(runs):
    root, out = runs
    d = out["moe"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "first use")
    fix = d["diagnosis"]["fix"]
    assert fix["verified"] is True, fix["verification"]
    assert fix["after"] == "n = keep.sum().clamp_min(1)  # LINE: count", fix  # the line that makes it
    assert f"realforms.py:{marker_line(TRAINING, 'count')}" in d["diagnosis"]["explanation"]
    assert len(fix["patched_calls"]) == 1 and fix["tested_as"] == "line"
    # the single-site patch is what failed before: it is still a candidate, after the root, and not verified
    site = d["diagnosis"]["candidates"][1:]
    assert not site or site[0]["verified"] is not True
    _apply_and_train(root, "moe", fix)


def test_model_wide_all_masked_attention_is_fixed_where_the_mask_is_built(runs):
    root, out = runs
    d = out["attention"]
    fix = d["diagnosis"]["fix"]
    assert d["diagnosis"]["cause"] == "softmax_all_masked"
    assert fix["kind"] == "finite_mask_value" and fix["verified"] is True, fix["verification"]
    assert fix["before"].startswith("mask = torch.zeros(pad.shape).masked_fill(pad, float(\"-inf\"))")
    assert "torch.finfo(" in fix["after"] and ").min)" in fix["after"]
    _apply_and_train(root, "attention", fix)


def test_log1mexp_under_bf16_autocast(runs):
    root, out = runs
    d = out["bf16"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "survival")
    diag = d["diagnosis"]
    assert diag["cause"] == "log1mexp", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["kind"] == "log1mexp" and fix["verified"] is True, fix["verification"]
    assert fix["after"].startswith("return -torch.log(-torch.expm1(-rate)).mean()") and fix["tested_as"] == "line"
    # in bfloat16 log1p(-exp(-r)) itself is off by a few rounding steps (2^-8 each): the fixed healthy steps are
    # judged against the loop in float64, not against the bfloat16 original
    _apply_and_train(root, "bf16", fix, coarse=True)
