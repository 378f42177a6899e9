"""Fixes whose line is not the culprit's own, on real loops analyzed where the training code cannot be imported,
each judged by applying it (isolation.apply_and_train) and training on:

* a NaN sample in a tuple batch (`nonfinite_input`): the root is in the data, and which sample is said; the stopgap
  is an edit of the line that hands the batch to the guard, leaving the sample out of every part of the batch;
* binary cross-entropy written on the output of an `nn.Sigmoid()` that an `nn.Sequential` calls: none of the
  sigmoid's ops has a line of the user's, so the edit goes where the Sequential was built (Sigmoid -> Identity),
  beside the loss line (logsigmoid of the logits);
* sqrt at zero in a bfloat16 model: `x + eps` would move every healthy value by more than bfloat16 resolves, so the
  ε is a `clamp_min`, which leaves every value above it exactly as it was.
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


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 1)

    def forward(self, feats, scale):
        return self.fc(feats) * scale[:, None]


def build_classifier():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1),
                         nn.Sigmoid())


def bce(p, y):
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # LINE: bce


class RmsNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        h = self.fc(x)
        return h / (h.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)  # LINE: sqrt


def mse(out, y):
    return ((out - y) ** 2).mean()


def make(kind):
    if kind == "nan_sample":
        return Scaled(), mse
    if kind == "sigmoid_seq":
        return build_classifier(), bce
    return RmsNorm().to(torch.bfloat16), mse


def batch(kind, step):
    g = torch.Generator().manual_seed(step)
    if kind == "nan_sample":
        feats, scale = torch.randn(4, 5, generator=g), torch.rand(4, generator=g) + 0.5
        if step == 2:
            feats[1, 3] = float("nan")  # a missing value read as NaN
        return (feats, scale), torch.randn(4, 1, generator=g)
    if kind == "sigmoid_seq":
        x = torch.randn(8, 6, generator=g)
        if step == 2:
            x[5] *= 1e5  # an unnormalised sample
        return x, (torch.rand(8, 1, generator=g) > 0.5).float()
    x = torch.randn(4, 8, generator=g)
    if step == 2:
        x[2] = 0.0  # a blank row: the layer's output is 0, its RMS 0
    return x.to(torch.bfloat16), (0.5 * torch.randn(4, 8, generator=g)).to(torch.bfloat16)


class NoGuard:
    def begin(self, *args, **kwargs):
        pass


def run(kind, folder=None, f64=False):
    torch.manual_seed(0)
    model, loss_fn = make(kind)
    if f64:
        model = model.double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder) if folder else NoGuard()
    out = []
    for step in range(4):
        x, y = batch(kind, step)
        if f64:
            x, y = (tuple(v.double() for v in x) if isinstance(x, tuple) else x.double()), y.double()
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = loss_fn(model(*x) if isinstance(x, tuple) else model(x), y)
        if folder:
            if not guard.step(loss):
                return guard.last_snapshot
            continue
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
        out.append((float(loss), float(norm)))
        if torch.isfinite(norm) and torch.isfinite(loss):
            opt.step()
    return out


if __name__ == "__main__":
    if sys.argv[1] in ("--plain", "--f64"):
        print(json.dumps({k: run(k, f64=sys.argv[1] == "--f64") for k in sys.argv[2:]}))
    else:
        for kind in sys.argv[2:]:
            print(kind, run(kind, f"{sys.argv[1]}/{kind}"))
'''

pytestmark = pytest.mark.integrations  # training loops run and analyzed in subprocesses, as test_real_bugs.py

KINDS = ("nan_sample", "sigmoid_seq", "sqrt")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataedits")
    return root, train_and_analyze_isolated(root, "dataedits", TRAINING, KINDS, ENV)


def test_a_nan_sample_is_left_out_where_the_batch_enters_the_step(runs):
    root, out = runs
    d = out["nan_sample"]
    assert d["verdict"] == "nonfinite_input"
    assert "[1]" in d["diagnosis"]["explanation"]  # which sample: the root is in the data
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "clean_input" and len(fix["edits"]) == 1, fix
    keep, inputs, target, line = fix["edits"][0]["after"].splitlines()
    assert keep.split("  #")[0] == "keep = torch.isfinite(x[0]).flatten(1).all(1)", keep
    assert "samples [1]" in keep and "in the data" in keep
    assert inputs == "x = tuple(v[keep] for v in x)" and target == "y = y[keep]", fix
    assert line == "guard.begin(x, y, step=step)" == fix["edits"][0]["before"]
    apply_and_train(root / "fixed_nan_sample", TRAINING, "dataedits", "nan_sample", fix, bad=2, env=ENV)


def test_a_sigmoid_module_in_a_sequential_is_edited_where_the_sequential_is_built(runs):
    root, out = runs
    d = out["sigmoid_seq"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "bce")
    diag = d["diagnosis"]
    assert diag["cause"] == "bce_saturated"
    fix = diag["fix"]
    assert fix["kind"] == "bce_with_logits" and fix["verified"] is True, fix["verification"]
    built, loss = fix["edits"]
    assert built["before"].startswith("return nn.Sequential(") and built["before"].endswith("nn.Sigmoid())")
    assert built["after"] == built["before"].replace("nn.Sigmoid()", "nn.Identity()"), built
    assert "F.logsigmoid(p)" in loss["after"] or "functional.logsigmoid(p)" in loss["after"], loss
    assert "nn.Identity()" in fix["reasoning"]
    apply_and_train(root / "fixed_sigmoid_seq", TRAINING, "dataedits", "sigmoid_seq", fix, bad=2, env=ENV)


def test_an_epsilon_in_bfloat16_is_a_clamp_that_leaves_healthy_values_alone(runs):
    root, out = runs
    d = out["sqrt"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "sqrt")
    diag = d["diagnosis"]
    assert diag["cause"] == "sqrt_at_zero"
    fix = diag["fix"]
    assert fix["kind"] == "epsilon" and ".clamp_min(" in fix["after"] and " + 1e" not in fix["after"].split(
        ".sqrt()")[0], fix
    assert fix["verified"] is True, (fix["verification"], [c.get("verification") for c in diag.get("candidates", [])])
    apply_and_train(root / "fixed_sqrt", TRAINING, "dataedits", "sqrt", fix, bad=2, env=ENV, coarse=True)
