"""Families the third real-bug round found (benchmarks/realbugs: gumbel_tau_annealed_zero, negbinom_theta_underflow),
on loops of their own written differently, analyzed where the training code cannot be imported, each fix judged by
applying it (isolation.apply_and_train):

* a temperature annealed to 0 and passed as a Python number: inside F.gumbel_softmax (positionally) and in the
  user's own `logits / temperature`. The divisor is not a tensor, so nothing used to claim it (cause
  "unrecognised", no fix); the fix floors the number where the user passes it (zero_scalar_divisor);
* a negative binomial whose total_count underflows to 0 (softplus of a very negative value): lgamma(0) runs inside
  torch.distributions on the user's log_prob line, where there is no lgamma to rewrite; the clamp is made where
  the user made the value (fixes.hidden_root), an edit instead of an op-level patch.
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
from torch.distributions import NegativeBinomial
from nanreplay import NanGuard


class Quantizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 5), nn.Linear(5, 6)

    def forward(self, x, tau):
        return self.dec(F.gumbel_softmax(self.enc(x), tau, True))  # LINE: gumbel


class Pointer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, temperature):
        w = torch.softmax(self.q(x) / temperature, dim=-1)  # LINE: userdiv
        return w * self.v(x)


class Counts(nn.Module):
    def __init__(self):
        super().__init__()
        self.r, self.logit = nn.Linear(3, 4), nn.Linear(3, 4)

    def forward(self, x):
        r = F.softplus(self.r(x))
        return r, self.logit(x)


def nb_nll(out, k):
    r, logits = out
    return -NegativeBinomial(r, logits=logits, validate_args=False).log_prob(k).mean()  # LINE: negbinom


def batches(kind, step):
    g = torch.Generator().manual_seed(step)
    if kind == "negbinom":
        x = torch.randn(6, 3, generator=g)
        if step == 2:  # an unscaled row: the dispersion head goes far below -104, softplus gives exactly 0
            torch.manual_seed(0)
            x[3] = -500.0 * Counts().r.weight.sum(0).sign()
        return (x,), torch.poisson(torch.full((6, 4), 2.0), generator=g) + 1
    x = torch.randn(6, 6, generator=g)
    return (x, max(1.0 - 0.5 * step, 0.0)), x  # the temperature schedule reaches 0 at step 2


MODELS = {"gumbel": (Quantizer, F.mse_loss), "userdiv": (Pointer, F.mse_loss), "negbinom": (Counts, nb_nll)}


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
        loss = loss_fn(model(*x), y)
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

KINDS = ("gumbel", "userdiv", "negbinom")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("realbugs3")
    return root, train_and_analyze_isolated(root, "realbugs3", TRAINING, KINDS, ENV)


@pytest.mark.parametrize("kind, after", [("gumbel", "F.gumbel_softmax(self.enc(x), max(tau, 1e-"),
                                         ("userdiv", "self.q(x) / max(temperature, 1e-")])
def test_a_temperature_of_zero_is_floored_where_the_user_passes_it(runs, kind, after):
    root, out = runs
    d = out[kind]
    assert d["culprit"]["op"].startswith("aten.div") and d["culprit"]["scalars"] == [0.0]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, kind)
    diag = d["diagnosis"]
    assert diag["cause"] == "zero_scalar_divisor", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["kind"] == "epsilon" and fix["verified"] is True and fix["tested_as"] == "line", fix["verification"]
    assert len(fix["edits"]) == 1 and after in fix["edits"][0]["after"], fix["edits"]
    apply_and_train(root / f"fixed_{kind}", TRAINING, "realbugs3", kind, fix, bad=2, env=ENV)


def test_lgamma_inside_a_distribution_is_fixed_where_the_user_made_its_input(runs):
    root, out = runs
    d = out["negbinom"]
    assert d["culprit"]["op"] == "aten.lgamma.default"  # inside torch.distributions
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "negbinom")  # the user's log_prob line
    diag = d["diagnosis"]
    assert diag["cause"] == "domain_edge"
    fix = diag["fix"]
    assert fix["tested_as"] == "line" and [e["after"] for e in fix["edits"]] == \
        [f"r = F.softplus(self.r(x)).clamp_min({fix['epsilon']:.0e}".replace("e-0", "e-") + ")"], fix["edits"]
    apply_and_train(root / "fixed_negbinom", TRAINING, "realbugs3", "negbinom", fix, bad=2, env=ENV)
