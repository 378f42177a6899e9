"""Distribution and data-only families of the real-bug benchmark (benchmarks/realbugs: beta_policy_action_one,
dirichlet_prior_zero_topic, sisdr_silent_target, kldiv_log_of_softmax), on loops of their own written differently,
analyzed where the training code cannot be imported, each fix judged by applying it (isolation.apply_and_train):

* a Gamma and a Beta log_prob (torch.distributions) scored at the edge of the support (a waiting time of 0, a
  fraction of 0): xlogy(c - 1, 0) = -inf inside torch; the user's log_prob call gets the value clamped into the open
  support (clamp_min(eps) for (0, inf), clamp(eps, 1 - eps) for (0, 1)), eps from the dtype;
* an SI-SNR projection on an all-zero reference: no ε verifies (the log of a zero energy follows), so the remedy is
  the data's: the diagnosis says which rows to leave out, and leaving them out trains on;
* log of a softmax the model's forward returns: two edits (log_softmax in the forward, the log dropped in the loss).
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
from torch.distributions import Beta, Gamma
from nanreplay import NanGuard


class Rate(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(3, 2)

    def forward(self, x):
        return F.softplus(self.net(x)) + 1.0


def gamma_nll(params, waits):
    return -Gamma(params[:, 0], params[:, 1]).log_prob(waits).mean()  # LINE: gamma


def beta_nll(params, frac):
    a, b = params.unbind(-1)
    return -Beta(a, b).log_prob(value=frac).mean()  # LINE: beta


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 16)

    def forward(self, x):
        return self.net(x)


def si_snr(est, ref):
    dot = (est * ref).sum(-1, keepdim=True)
    proj = dot * ref / ref.pow(2).sum(-1, keepdim=True)  # LINE: sisnr
    return -(10 * torch.log10(proj.pow(2).sum(-1) / (est - proj).pow(2).sum(-1))).mean()


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return F.softmax(self.fc(x), dim=-1)  # LINE: softmax


def smoothed_kl(probs, labels):
    target = torch.full_like(probs, 0.02).scatter(1, labels[:, None], 0.92)
    return F.kl_div(torch.log(probs), target, reduction="batchmean")  # LINE: kldiv


def batches(kind, step):
    g = torch.Generator().manual_seed(step)
    if kind == "gamma":
        w = torch.rand(6, generator=g) * 3 + 0.5
        if step == 2:
            w[1] = 0.0  # a zero waiting time, logged as 0
        return torch.randn(6, 3, generator=g), w
    if kind == "beta":
        f = torch.rand(6, generator=g) * 0.8 + 0.1
        if step == 2:
            f[4] = 0.0  # a fraction of exactly 0
        return torch.randn(6, 3, generator=g), f
    if kind == "sisnr":
        ref = torch.randn(3, 16, generator=g)
        if step == 2:
            ref[0] = 0.0  # a silent reference
        return ref + 0.1 * torch.randn(3, 16, generator=g), ref
    x = torch.randn(4, 4, generator=g)
    if step == 2:
        x[2] *= 3000.0  # an unscaled sample
    return x, torch.randint(0, 5, (4,), generator=g)


MODELS = {"gamma": (Rate, gamma_nll), "beta": (Rate, beta_nll), "sisnr": (Denoiser, si_snr),
          "kldiv": (Classifier, smoothed_kl)}


def run(kind, folder=None, f64=False):
    torch.manual_seed(0)
    cls, loss_fn = MODELS[kind]
    model = cls()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder) if folder else None
    out = []
    for step in range(4):
        x, y = batches(kind, step)
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        if guard:
            if not guard.step(loss):
                return guard.last_snapshot
            continue
        loss.backward()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
        out.append((loss.item(), norm.item()))
        if torch.isfinite(norm):  # a failed step is not taken: the next batches still run
            opt.step()
    return out


if __name__ == "__main__":
    if sys.argv[1] in ("--plain", "--f64"):
        print(json.dumps({k: run(k) for k in sys.argv[2:]}))
    else:
        for kind in sys.argv[2:]:
            print(kind, run(kind, f"{sys.argv[1]}/{kind}"))
'''

pytestmark = pytest.mark.integrations  # training loops run and analyzed in subprocesses, as test_real_bugs.py

KINDS = ("gamma", "beta", "sisnr", "kldiv")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("realdist")
    return root, train_and_analyze_isolated(root, "realdist", TRAINING, KINDS, ENV)


def _applied(root, kind: str, fix: dict) -> None:
    apply_and_train(root / f"fixed_{kind}", TRAINING, "realdist", kind, fix, bad=2, env=ENV)


@pytest.mark.parametrize("kind, clamp", [("gamma", "waits.clamp_min(torch.finfo(waits.dtype).eps)"),
                                         ("beta", "frac.clamp(torch.finfo(frac.dtype).eps, "
                                                  "1 - torch.finfo(frac.dtype).eps)")])
def test_log_prob_at_the_support_edge_clamps_the_value_on_the_users_line(runs, kind, clamp):
    root, out = runs
    d = out[kind]
    assert d["culprit"]["op"].startswith("aten.xlogy")  # inside torch.distributions
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, kind)  # the user's log_prob call
    diag = d["diagnosis"]
    assert diag["cause"] == "log_prob_at_support_edge", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["kind"] == "clamp" and fix["verified"] is True and fix["tested_as"] == "line", fix["verification"]
    assert clamp in fix["after"] and len(fix["edits"]) == 1, fix
    _applied(root, kind, fix)


def test_zero_reference_norm_says_the_remedy_is_in_the_data_and_which_rows(runs):
    root, out = runs
    d = out["sisnr"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "sisnr")
    diag = d["diagnosis"]
    assert diag["cause"] == "normalize_zero_norm"
    fix = diag["fix"]
    # the ε candidates replayed and still broke (log10 of a zero energy): the row filter is what is shown, as an
    # edit above the culprit's statement that leaves out the rows every later line of the loss reads
    assert fix["kind"] == "mask_rows" and len(fix["edits"]) == 1, fix
    assert "did not verify" in fix["verification"] and "remedy is in the data" in fix["reasoning"]
    keep, filtered, line = fix["edits"][0]["after"].splitlines()
    assert keep.split("  #")[0] == "keep = ref.pow(2).sum(-1) > 0", keep
    assert "[0] in the failing batch" in keep and "rows of 'target' in this batch: [0]" in fix["reasoning"]
    assert filtered == "dot, ref, est = dot[keep], ref[keep], est[keep]", filtered
    assert fix["edits"][0]["before"] == line.strip()
    _applied(root, "sisnr", fix)  # applied: those rows left out before the loss is computed, and it trains on


def test_log_of_a_softmax_from_the_forward_is_two_edits(runs):
    root, out = runs
    d = out["kldiv"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "kldiv")
    diag = d["diagnosis"]
    assert diag["cause"] == "log_softmax"
    fix = diag["fix"]
    assert fix["kind"] == "log_softmax" and fix["verified"] is True, fix["verification"]
    assert [e["after"].split("  #")[0] for e in fix["edits"]] == [
        "return F.log_softmax(self.fc(x), dim=-1)", 'return F.kl_div(probs, target, reduction="batchmean")'], fix
    assert "log-probabilities" in fix["reasoning"]
    _applied(root, "kldiv", fix)
