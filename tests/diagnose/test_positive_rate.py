"""A quantity that must be positive made non-negative by a ReLU (or a clamp at 0), then logged, divided by, or put
under an rsqrt (diagnose/edits/posfix.py): a Poisson rate through F.relu into log, a scale through clamp(min=0) as a
divisor, a Normal's std through torch.relu into Normal.log_prob (log(scale) runs inside torch.distributions), a
variance through .relu() under rsqrt, a rate through .clamp_min(0) logged in a helper the forward calls, a Poisson's
and a Gamma's rate through F.relu into torch.distributions' xlogy(c, rate) (the support rule clamped the scored value
there, while its replay clamped the rate: the edit shown did not fix it). Before,
each got an ε at the log / divisor that does not verify (the loss moves with ε: the dead unit's log(ε) has no
gradient back); the fix is softplus at the ReLU's line. Each loop is analyzed where the training code cannot be
imported, and the edit shown is applied to a copy of the loop, which trains on finite (the healthy steps differ by
design: softplus is another function than relu).
"""

from __future__ import annotations

import ast

import pytest
from isolation import ROOT, apply_and_train, marker_line, train_and_analyze_isolated

from nanreplay.diagnose.edits.posfix import _relu_input

TRAINING = r'''
import json
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Normal
from nanreplay import NanGuard


class Poisson(nn.Module):
    def __init__(self):
        super().__init__()
        self.rate = nn.Linear(4, 1)

    def forward(self, x):
        lam = F.relu(self.rate(x)).squeeze(-1)  # LINE: poisson_make
        return lam


def poisson_nll(lam, k):
    return (lam - k * torch.log(lam)).mean()  # LINE: poisson


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale, self.head = nn.Linear(4, 1), nn.Linear(4, 2)

    def forward(self, x):
        s = self.scale(x).clamp(min=0)  # LINE: divide_make
        return self.head(x) / s  # LINE: divide


class Gauss(nn.Module):
    def __init__(self):
        super().__init__()
        self.mu, self.sigma = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.mu(x), torch.relu(self.sigma(x))  # LINE: normal_make


def gauss_nll(out, y):
    mu, std = out
    return -Normal(mu, std, validate_args=False).log_prob(y).mean()  # LINE: normal


class Whiten(nn.Module):
    def __init__(self):
        super().__init__()
        self.var, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        v = self.var(x).relu()  # LINE: rsqrt_make
        return self.head(x * torch.rsqrt(v))  # LINE: rsqrt


def counts_nll(lam, k):
    return (lam - k * torch.log(lam)).mean()  # LINE: helper


class PoissonLoss(nn.Module):
    """The model returns its own loss, computed by a helper function its forward calls."""

    def __init__(self):
        super().__init__()
        self.rate = nn.Linear(4, 1)

    def forward(self, x, k):
        lam = self.rate(x).squeeze(-1).clamp_min(0)  # LINE: helper_make
        return counts_nll(lam, k)


def pois_nll(lam, k):
    return -torch.distributions.Poisson(lam, validate_args=False).log_prob(k).mean()  # LINE: dpois


def gamma_nll(out, y):
    a, b = out
    return -torch.distributions.Gamma(a, b, validate_args=False).log_prob(y.abs() + 0.1).mean()  # LINE: dgamma


class GammaHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conc, self.rate = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return F.softplus(self.conc(x)) + 1.0, F.relu(self.rate(x))  # LINE: dgamma_make


class MaskRate(nn.Module):
    def __init__(self):
        super().__init__()
        self.rate = nn.Linear(4, 1)

    def forward(self, x):
        z = self.rate(x).squeeze(-1)
        return z * (z > 0)  # LINE: maskmul_make


class SeqRate(nn.Module):
    def __init__(self):
        super().__init__()
        self.rate = nn.Sequential(nn.Linear(4, 1), nn.ReLU())  # LINE: seq_make

    def forward(self, x):
        return self.rate(x).squeeze(-1)


MODELS = {"maskmul": (MaskRate, poisson_nll), "seq": (SeqRate, poisson_nll), "dpois": (Poisson, pois_nll),
          "dgamma": (GammaHead, gamma_nll),
          "helper": (PoissonLoss, None),
          "poisson": (Poisson, poisson_nll), "divide": (Scaled, F.mse_loss),
          "normal": (Gauss, gauss_nll), "rsqrt": (Whiten, F.mse_loss)}


def batches(kind, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 4, generator=g) * 0.3
    if step == 2:  # one sample far along what lowers the pre-activation: the ReLU gives exactly 0
        torch.manual_seed(0)
        m = MODELS[kind][0]()
        w = {"maskmul": lambda: m.rate.weight, "seq": lambda: m.rate[0].weight, "dpois": lambda: m.rate.weight,
             "dgamma": lambda: m.rate.weight,
             "poisson": lambda: m.rate.weight,
             "helper": lambda: m.rate.weight, "divide": lambda: m.scale.weight,
             "normal": lambda: m.sigma.weight, "rsqrt": lambda: m.var.weight}[kind]()
        x[3] = -4.0 * w.sum(0).sign()
    if kind in ("poisson", "helper", "dpois", "seq", "maskmul"):
        k = torch.poisson(torch.full((6,), 2.0), generator=g)
        return ((x, k), None) if kind == "helper" else (x, k)
    return x, torch.randn(6, 2, generator=g)


def run(kind, folder=None, f64=False):
    torch.manual_seed(0)
    cls, loss_fn = MODELS[kind]
    model = cls()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and name.split(".")[0] in ("rate", "scale", "sigma", "var", "conc"):
                p.fill_(1.0)  # a positive rate/scale to start
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder) if folder else None
    out = []
    for step in range(6):
        x, y = batches(kind, step)
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = model(*x) if loss_fn is None else loss_fn(model(x), y)
        if guard:
            if not guard.step(loss):
                return guard.last_snapshot
            continue
        loss.backward()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
        out.append((loss.item(), norm.item()))
        if torch.isfinite(norm):
            opt.step()
    return out


if __name__ == "__main__":
    if sys.argv[1] in ("--plain", "--f64"):
        print(json.dumps({k: run(k) for k in sys.argv[2:]}))
    else:
        for kind in sys.argv[2:]:
            print(kind, run(kind, f"{sys.argv[1]}/{kind}"))
'''

KINDS = ("poisson", "divide", "normal", "rsqrt", "helper", "dpois", "dgamma", "seq", "maskmul")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
MADE = {"poisson": "lam = {F}.softplus(self.rate(x)).squeeze(-1)",
        "divide": "s = {F}.softplus(self.scale(x))",
        "normal": "return self.mu(x), {F}.softplus(self.sigma(x))",
        "rsqrt": "v = {F}.softplus(self.var(x))",
        "helper": "lam = {F}.softplus(self.rate(x).squeeze(-1))",
        "dpois": "lam = {F}.softplus(self.rate(x)).squeeze(-1)",
        "dgamma": "return {F}.softplus(self.conc(x)) + 1.0, {F}.softplus(self.rate(x))",
        "seq": "self.rate = nn.Sequential(nn.Linear(4, 1), nn.Softplus())",
        "maskmul": "return {F}.softplus(z)"}
CAUSE = {"poisson": "log_of_zero", "divide": "division_by_zero", "normal": "log_of_zero", "rsqrt": "domain_edge",
         "helper": "log_of_zero", "dpois": "log_prob_at_support_edge", "dgamma": "log_prob_at_support_edge",
         "seq": "log_of_zero", "maskmul": "log_of_zero"}
# the marker of the line each kind's fix edits (dpois reuses Poisson's; seq's ReLU is an nn.ReLU() child of a
# Sequential, edited where the Sequential is built, and replayed as an op-level patch at its relu)
MAKE = {"dpois": "poisson_make"}
CULPRIT = {"seq": "poisson", "maskmul": "poisson"}
TESTED_AS = {"seq": "op"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("posrate")
    return root, train_and_analyze_isolated(root, "posrate", TRAINING, KINDS, ENV)


@pytest.mark.integrations
@pytest.mark.parametrize("kind", KINDS)
def test_a_relu_made_rate_gets_softplus_where_it_is_made(runs, kind):
    root, out = runs
    d = out[kind]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, CULPRIT.get(kind, kind))  # the log's line ...
    diag = d["diagnosis"]
    assert diag["cause"] == CAUSE[kind], (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["kind"] == "positive_parametrisation" and fix["tested_as"] == TESTED_AS.get(kind, "line"), fix
    (edit,) = fix["edits"]
    assert edit["line"] == marker_line(TRAINING, MAKE.get(kind, f"{kind}_make")), edit  # the ReLU's, not the culprit's
    assert edit["after"].split("  #")[0] in (MADE[kind].format(F="F"), MADE[kind].format(F="torch.nn.functional"))
    # verified where the softplus step's loss is in the history's range; where the outlier's scale is small but
    # positive (1/softplus(-3) ≈ 20), the true loss is large: finite, shown, and not verified
    assert fix["verified"] is (kind not in ("divide", "normal")), fix["verification"]
    assert fix["replay"]["loss"] is not None
    fixed = apply_and_train(root / f"fixed_{kind}", TRAINING, "posrate", kind, fix, bad=2, env=ENV,
                            changes_model=True)
    assert fixed[2][1] > 0  # the step that broke now trains the rate's layer


@pytest.mark.integrations
def test_a_helper_the_forward_calls_is_the_models_code_not_step_code(runs):
    """The log runs in counts_nll(), a plain function the model's forward calls (the model returns its loss): it
    is the model's code, not "the loss/step code outside the model's modules"."""
    _, out = runs
    d = out["helper"]
    assert d["culprit"]["module"] == "" and d["culprit"]["source"]["function"] == "counts_nll"
    expl = d["diagnosis"]["explanation"]
    assert "(in counts_nll(), a function the model's own forward called)" in expl, expl
    assert "loss/step code" not in expl


@pytest.mark.parametrize("code, z", [("F.relu(h @ w)", "h @ w"), ("torch.relu(z)", "z"), ("self.lin(x).relu()",
                                     "self.lin(x)"), ("z.clamp(min=0)", "z"), ("z.clamp(0)", "z"),
                                     ("torch.clamp(z, min=0.0)", "z"), ("z.clamp_min(0)", "z"),
                                     ("torch.clamp(z, 0, None)", "z"),
                                     ("z.clamp(min=1e-3)", None), ("z.clamp(0, 1)", None), ("z.clamp(max=0)", None),
                                     ("F.relu(z, inplace=True)", None), ("z.clamp_min(eps)", None),
                                     ("torch.exp(z)", None), ("z * (z > 0)", "z"), ("(h @ w > 0).float() * (h @ w)",
                                                                                "h @ w"),
                                     ("z * (y > 0)", None), ("z * (z > 1)", None), ("z * (z >= 0)", None)])
def test_only_an_exact_max_with_zero_is_taken_for_a_relu(code, z):
    node = ast.parse(code, mode="eval").body
    got = _relu_input(node)
    assert (ast.unparse(got) if got is not None else None) == z
