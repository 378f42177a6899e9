"""Families the third real-bug round found (benchmarks/realbugs: gumbel_tau_annealed_zero, negbinom_theta_underflow),
on loops of their own written differently, analyzed where the training code cannot be imported, each fix judged by
applying it (isolation.apply_and_train):

* a temperature annealed to 0 and passed as a Python number: inside F.gumbel_softmax (positionally) and in the
  user's own `logits / temperature`. The divisor is not a tensor, so nothing used to claim it (cause
  "unrecognised", no fix); the fix floors the number where the user passes it (zero_scalar_divisor);
* a negative binomial whose total_count underflows to 0 (softplus of a very negative value): lgamma(0) runs inside
  torch.distributions on the user's log_prob line, where there is no lgamma to rewrite; the clamp is made where
  the user made the value (fixes.hidden_root), an edit instead of an op-level patch;
* a GAN's discriminator loss log(D(x)) + log(1 - D(G(z))) with both sigmoids made in the forward: only the sigmoid
  that saturated is edited (its line made the logits, its log a logsigmoid); the edit used to hit that line twice;
* exp(e) / exp(e).sum(d, keepdim=True) on one line (two exp calls): the division becomes F.softmax(e, dim=d);
* a Lorentz exp map, cosh and sinh of one norm: the clamp of cosh's input alone left sinh overflowing (applied, it
  still broke); the clamp is made where the norm is made, at a bound the replay verifies finite;
* log(1 - exp(x)) with x exactly 0 (a log-probability of 0: unlikelihood training on a certain token): the exact
  form log(-expm1(x)) is -inf there too; 1 - exp(x) floored at the log is the candidate after it.
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


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, real, fake):
        p_real = self.net(real).sigmoid()
        p_fake = self.net(fake).sigmoid()
        return p_real, p_fake


def d_loss(out, _):
    p_real, p_fake = out
    return -(torch.log(p_real) + torch.log(1 - p_fake)).mean()  # LINE: gan


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.score, self.out = nn.Linear(4, 1), nn.Linear(4, 2)

    def forward(self, x):
        e = self.score(x).squeeze(-1)
        a = e.exp() / e.exp().sum(dim=1, keepdim=True)  # LINE: attn
        return self.out((a.unsqueeze(-1) * x).sum(1))


def to_hyperboloid(v):
    r = v.norm(dim=-1, keepdim=True) + 1e-9  # LINE: lroot
    return torch.cat([r.cosh(), r.sinh() * v / r], -1)  # LINE: lorentz


class Hyp(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(5, 3), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(to_hyperboloid(self.lin(x)))


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        return F.log_softmax(self.fc(x), -1)


def ul_loss(lp, y):
    p_y = lp.gather(1, y[:, None]).exp()
    return -torch.log(1 - p_y).mean()  # LINE: ul


def batches(kind, step):
    g = torch.Generator().manual_seed(step)
    if kind == "lorentz":
        x = torch.randn(6, 5, generator=g)
        if step == 2:
            x[1] *= 500.0  # an unnormalised node: its tangent norm is far above cosh's and sinh's range
        return (x,), torch.randint(0, 2, (6,), generator=g)
    if kind == "ul":
        x, y = torch.randn(6, 6, generator=g), torch.randint(0, 5, (6,), generator=g)
        if step == 2:  # a context the model is certain about, scored on the very token it is certain of
            x[2] *= 1e3
            torch.manual_seed(0)
            with torch.no_grad():
                y[2] = Scorer()(x[2:3]).argmax()
        return (x,), y
    if kind in ("gan", "attn"):
        torch.manual_seed(0)
        w = (Critic().net if kind == "gan" else Pool().score).weight.sum(0).sign()  # the initial weights' signs
        a, b = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
        if kind == "gan":
            if step == 2:
                b[1] = 300.0 * w  # a generated sample the critic takes for real with certainty: sigmoid = 1.0
            return (a, b), None
        x = torch.randn(3, 5, 4, generator=g)
        if step == 2:
            x[1, 2] = 300.0 * w  # one frame far along what the scorer rewards: exp(energy) = Inf
        return (x,), torch.randint(0, 2, (3,), generator=g)
    if kind == "negbinom":
        x = torch.randn(6, 3, generator=g)
        if step == 2:  # an unscaled row: the dispersion head goes far below -104, softplus gives exactly 0
            torch.manual_seed(0)
            x[3] = -500.0 * Counts().r.weight.sum(0).sign()
        return (x,), torch.poisson(torch.full((6, 4), 2.0), generator=g) + 1
    x = torch.randn(6, 6, generator=g)
    return (x, max(1.0 - 0.5 * step, 0.0)), x  # the temperature schedule reaches 0 at step 2


MODELS = {"gumbel": (Quantizer, F.mse_loss), "userdiv": (Pointer, F.mse_loss), "negbinom": (Counts, nb_nll),
          "gan": (Critic, d_loss), "attn": (Pool, F.cross_entropy), "lorentz": (Hyp, F.cross_entropy),
          "ul": (Scorer, ul_loss)}


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

KINDS = ("gumbel", "userdiv", "negbinom", "gan", "attn", "lorentz", "ul")
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


def _f(after: str) -> str:
    """An edit's code without its comment, torch.nn.functional spelled F (the recorded lines hold no import)."""
    return after.split("  #")[0].replace("torch.nn.functional.", "F.")


def test_two_sigmoids_in_one_loss_statement_edit_only_the_one_that_saturated(runs):
    root, out = runs
    d = out["gan"]
    assert d["culprit"]["op"] == "aten.log.default"
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "gan")
    diag = d["diagnosis"]
    assert diag["cause"] == "bce_saturated"
    fix = diag["fix"]
    assert fix["verified"] is True, fix["verification"]
    assert [(e["before"], _f(e["after"])) for e in fix["edits"]] == [
        ("p_fake = self.net(fake).sigmoid()", "p_fake = self.net(fake)"),
        ("return -(torch.log(p_real) + torch.log(1 - p_fake)).mean()  # LINE: gan",
         "return -(torch.log(p_real) + F.logsigmoid(-p_fake)).mean()")], fix["edits"]
    apply_and_train(root / "fixed_gan", TRAINING, "realbugs3", "gan", fix, bad=2, env=ENV)


def test_a_softmax_written_with_two_exps_on_one_line_becomes_softmax(runs):
    root, out = runs
    d = out["attn"]
    assert d["culprit"]["op"] == "aten.exp.default"
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "attn")
    diag = d["diagnosis"]
    assert diag["cause"] == "handwritten_softmax"
    fix = diag["fix"]
    assert fix["verified"] is True and fix["tested_as"] == "line", fix["verification"]
    assert [_f(e["after"]) for e in fix["edits"]] == ["a = F.softmax(e, dim=1)"], fix["edits"]
    apply_and_train(root / "fixed_attn", TRAINING, "realbugs3", "attn", fix, bad=2, env=ENV)


def test_cosh_and_sinh_of_one_norm_are_clamped_where_the_norm_is_made(runs):
    root, out = runs
    d = out["lorentz"]
    assert d["culprit"]["op"] == "aten.cosh.default"
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "lorentz")
    fix = d["diagnosis"]["fix"]
    assert d["diagnosis"]["cause"] == "domain_edge" and fix["kind"] == "clamp"
    (edit,) = fix["edits"]
    assert edit["line"] == marker_line(TRAINING, "lroot"), fix["edits"]
    assert edit["after"].startswith("r = (v.norm(dim=-1, keepdim=True) + 1e-9).clamp(-"), edit
    apply_and_train(root / "fixed_lorentz", TRAINING, "realbugs3", "lorentz", fix, bad=2, env=ENV)


def test_log_of_one_minus_a_probability_of_exactly_one_is_floored(runs):
    root, out = runs
    d = out["ul"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "ul")
    diag = d["diagnosis"]
    assert diag["cause"] == "log1mexp"
    assert diag["candidates"][0]["kind"] == "log1mexp" and diag["candidates"][0]["verified"] is False
    fix = diag["fix"]
    assert fix["kind"] == "clamp" and fix["verified"] is True, fix["verification"]
    assert [e["after"].split("  #")[0] for e in fix["edits"]] == ["return -torch.log((1 - p_y).clamp_min(1e-7)).mean()"]
    apply_and_train(root / "fixed_ul", TRAINING, "realbugs3", "ul", fix, bad=2, env=ENV)
