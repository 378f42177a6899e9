"""Cause rules for real-bug families (benchmarks/realbugs), on training loops analyzed where the training code
cannot be imported, each fix judged by applying it (isolation.apply_and_train): the shown line put into a copy
of the training file and trained on — finite at every step, the healthy steps before the failure unchanged.

* a VAE whose log-variance is exponentiated twice (the reparameterisation's exp(0.5 * logvar) and the KL term's
  logvar.exp()): clamped where it is made, not at one exp (which leaves the other overflowing);
* CTC with a target longer than its input, recorded as aten._ctc_loss: zero_infinity=True on the call's line;
* a padding mask filled with -float('-inf') (which is +inf): the softmax of a row holding +inf is NaN; the mask
  line gets torch.finfo(dtype).min;
* GPT-2's `w * b - C * (1 - b)` with C = 1e10 a buffer that model.half() made inf: inf * 0 = NaN; the constant is
  kept at float16's largest value; the same with C = torch.tensor(1e10).to(w.dtype): clamped before the cast;
* an entropy bonus p * log p over logits masked with -inf: 0 * -inf; the exact form clamps log p at finfo.min.
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
from nanreplay import NanGuard


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 8)
        self.mu = nn.Linear(8, 4)
        self.logvar = nn.Linear(8, 4)
        self.dec = nn.Linear(4, 6)

    def forward(self, x, eps):
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)  # LINE: logvar
        std = torch.exp(0.5 * logvar)  # LINE: std
        return self.dec(mu + eps * std), mu, logvar


def vae_loss(out, x):
    recon, mu, logvar = out
    kld = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
    return ((recon - x) ** 2).mean() + kld


class CRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 8)
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        return F.log_softmax(self.fc(self.rnn(x)[0]), -1)


def ctc(log_probs, target):
    targets, lengths = target
    return F.ctc_loss(log_probs, targets, torch.full((2,), 4, dtype=torch.long), lengths)  # LINE: ctc


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, -1)
        s = (q @ k.transpose(-1, -2)).masked_fill(pad[:, None, :], -float("-inf"))  # LINE: posmask
        return (s.softmax(-1) @ v).pow(2).mean()  # LINE: posmask softmax


class GPT2Block(nn.Module):
    def __init__(self, t=4):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.register_buffer("bias", torch.tril(torch.ones(t, t)))
        self.register_buffer("masked_bias", torch.tensor(1e10))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        w = q @ k.transpose(-1, -2) * 0.25
        b = self.bias.to(w.dtype)
        w = w * b - self.masked_bias * (1 - b)  # LINE: fp16 constant
        return (w.softmax(-1) @ v).float().pow(2).mean()


class CastBlock(GPT2Block):  # the constant made in float32 and cast where it is used (tf.cast(1e10, w.dtype))
    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        w = q @ k.transpose(-1, -2) * 0.25
        b = self.bias.to(w.dtype)
        w = w * b - torch.tensor(1e10).to(w.dtype) * (1 - b)  # LINE: fp16 cast
        return (w.softmax(-1) @ v).float().pow(2).mean()


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 5)

    def forward(self, x, allowed):
        return self.net(x).masked_fill(~allowed, float("-inf"))


def policy_loss(logits, actions):
    logps = F.log_softmax(logits, -1)
    entropy = -(torch.exp(logps) * logps).sum(-1)  # LINE: entropy
    return -logps.gather(1, actions[:, None]).mean() - 0.01 * entropy.mean()


def batches(kind, step):
    g = torch.Generator().manual_seed(step)
    if kind == "vae":
        x = torch.randn(4, 6, generator=g)
        if step == 2:
            x[0] *= 1e4  # a row with an unscaled column
        return (x, torch.randn(4, 4, generator=g)), x
    if kind == "ctc":
        targets, lengths = torch.randint(1, 6, (2, 4), generator=g), torch.tensor([2, 2])
        if step == 2:
            targets[1], lengths = torch.tensor([3, 3, 3, 3]), torch.tensor([2, 4])  # 3 3 3 3 needs 7 frames, not 4
        return (torch.randn(4, 2, 4, generator=g),), (targets, lengths)
    if kind == "posmask":
        pad = torch.zeros(2, 3, dtype=torch.bool)
        if step == 2:
            pad[1, 2] = True  # a padded key: masked with +inf
        return (torch.randn(2, 3, 4, generator=g), pad), None
    if kind.startswith("fp16"):
        return (torch.randn(2, 4, 8, generator=g).half(),), None
    allowed = torch.ones(4, 5, dtype=torch.bool)
    if step == 2:
        allowed[1, 3:] = False  # two actions illegal in this state
    return (torch.randn(4, 4, generator=g), allowed), torch.randint(0, 3, (4,), generator=g)


MODELS = {"vae": (VAE, vae_loss), "ctc": (CRNN, ctc), "posmask": (Attention, None), "fp16": (GPT2Block, None),
          "fp16cast": (CastBlock, None), "entropy": (Policy, policy_loss)}


def run(kind, folder=None, f64=False):
    """Four optimizer steps; with a folder, under NanGuard (stops at the failure); else plainly: (loss, grad norm)."""
    torch.manual_seed(0)
    cls, loss_fn = MODELS[kind]
    model = cls().half() if kind.startswith("fp16") else cls()
    # float16 weights: SGD (Adam's eps of 1e-8 is 0 in float16, and its update 0/0)
    opt = (torch.optim.SGD(model.parameters(), lr=1e-2) if kind.startswith("fp16") else
           torch.optim.Adam(model.parameters(), lr=1e-3))
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder) if folder else None
    out = []
    for step in range(4):
        x, y = batches(kind, step)
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        pred = model(*x)
        loss = loss_fn(pred, y) if loss_fn else pred
        if guard:
            if not guard.step(loss):
                return guard.last_snapshot
            continue
        loss.backward()
        norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
        out.append((loss.item(), norm.item()))
        opt.step()
    return out


if __name__ == "__main__":
    if sys.argv[1] in ("--plain", "--f64"):
        print(json.dumps({k: run(k) for k in sys.argv[2:]}))
    else:
        for kind in sys.argv[2:]:
            print(kind, run(kind, f"{sys.argv[1]}/{kind}"))
'''

pytestmark = pytest.mark.integrations  # training loops run and analyzed in subprocesses, as test_real_forms.py

KINDS = ("vae", "ctc", "posmask", "fp16", "fp16cast", "entropy")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("realbugs")
    return root, train_and_analyze_isolated(root, "realbugs", TRAINING, KINDS, ENV)


def _applied(root, kind: str, fix: dict, bad: int = 2) -> None:
    apply_and_train(root / f"fixed_{kind}", TRAINING, "realbugs", kind, fix, bad=bad, env=ENV)


def test_vae_log_variance_is_clamped_where_it_is_made_for_both_exps(runs):
    root, out = runs
    d = out["vae"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "std")
    diag = d["diagnosis"]
    assert diag["cause"] == "exp_overflow"
    fix = diag["fix"]
    # the line that makes logvar, at a bound both exps need: exp(logvar) binds (half of float32's 88: its square, in
    # the gradient norm, stays finite), exp(0.5 * logvar) is then finite too
    assert fix["before"] == "mu, logvar = self.mu(h), self.logvar(h)  # LINE: logvar", fix
    assert fix["after"].startswith("mu, logvar = self.mu(h), self.logvar(h).clamp(max=43)"), fix
    assert fix["tested_as"] == "line" and fix["replay"]["loss"] is not None  # the replay is finite
    assert f"realbugs.py:{marker_line(TRAINING, 'logvar')}" in fix["reasoning"]
    _applied(root, "vae", fix)


def test_ctc_recorded_as_its_aten_op_gets_zero_infinity_on_the_line(runs):
    root, out = runs
    d = out["ctc"]
    assert d["culprit"]["op"].startswith("aten._ctc_loss") and d["culprit"]["source"]["line"] == marker_line(TRAINING,
                                                                                                              "ctc")
    diag = d["diagnosis"]
    # (it once read "unrecognised": the culprit's kind was NaN, read from _ctc_loss's log_alpha, memory left unwritten
    # that held NaN from an earlier analysis in the same process; tests/replay/test_workspace_outputs.py)
    assert diag["cause"] == "ctc_infeasible", (diag["cause"], diag["title"], d["culprit"]["kind"],
                                               d["culprit"]["phase"], d["culprit"].get("call"))
    fix = diag["fix"]
    assert fix["kind"] == "zero_infinity" and fix["verified"] is True, fix["verification"]
    assert fix["after"].startswith("return F.ctc_loss(log_probs, targets, torch.full((2,), 4, dtype=torch.long), "
                                   "lengths, zero_infinity=True)"), fix
    _applied(root, "ctc", fix)


def test_mask_filled_with_positive_inf_is_rewritten_where_the_mask_is_made(runs):
    root, out = runs
    d = out["posmask"]
    # the culprit is the softmax (DESIGN: a constant's inf is literal, the conversion is the culprit); the fix is the
    # mask's line
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "posmask softmax")
    diag = d["diagnosis"]
    assert diag["cause"] == "mask_value_sign", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["kind"] == "finite_mask_value" and fix["verified"] is True, fix["verification"]
    assert fix["before"].startswith("s = (q @ k.transpose(-1, -2)).masked_fill(pad[:, None, :], -float(\"-inf\"))")
    assert "torch.finfo(" in fix["after"] and '"-inf"' not in fix["after"]
    assert f"realbugs.py:{marker_line(TRAINING, 'posmask')}" in diag["explanation"]
    _applied(root, "posmask", fix)


def test_fp16_constant_beyond_range_is_kept_finite(runs):
    root, out = runs
    d = out["fp16"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "fp16 constant")
    diag = d["diagnosis"]
    assert diag["cause"] == "constant_overflow", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["verified"] is True, fix["verification"]
    assert fix["after"].startswith("w = w * b - self.masked_bias.clamp_max(torch.finfo(torch.float16).max) * (1 - b)")
    _applied(root, "fp16", fix, bad=0)  # broken from the first half-precision step


def test_fp16_constant_cast_beyond_range_is_clamped_before_the_cast(runs):
    root, out = runs
    d = out["fp16cast"]
    assert d["culprit"]["op"].startswith("aten._to_copy")
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "fp16 cast")
    diag = d["diagnosis"]
    assert diag["cause"] == "constant_overflow", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["verified"] is True, fix["verification"]
    assert fix["after"].startswith("w = w * b - torch.tensor(1e10).clamp_max(torch.finfo(torch.float16).max)"
                                   ".to(w.dtype) * (1 - b)"), fix
    _applied(root, "fp16cast", fix, bad=0)


def test_entropy_over_masked_logits_gets_the_exact_form(runs):
    root, out = runs
    d = out["entropy"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "entropy")
    diag = d["diagnosis"]
    assert diag["cause"] == "zero_times_inf", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["kind"] == "finite_factor" and fix["verified"] is True and fix["epsilon"] is None, fix["verification"]
    assert fix["after"].startswith("entropy = -(torch.exp(logps) * logps.clamp_min(torch.finfo(torch.float32).min))")
    _applied(root, "entropy", fix)
