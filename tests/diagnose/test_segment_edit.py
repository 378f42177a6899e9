"""Issue 38: the segment softmax's fix is an edit of the user's exp line, not a comment. A GAT layer written as
PyG's first softmax (exp of the scores over their per-node `scatter` sum, pyg-team/pytorch_geometric#53) trained
under NanGuard; analyzed where neither the training code nor torch_geometric can be imported; the edit subtracts
each segment's maximum with the user's own `scatter(..., reduce="max")[index]`, is verified by replay, and is
applied to a copy of the file and trained on: finite at every step, the healthy steps unchanged."""

from __future__ import annotations

import subprocess
import sys

import pytest
from isolation import ROOT, analyze_isolated, apply_and_train, marker_line

TRAINING = r'''
import json
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch_geometric.utils import scatter
from nanreplay import NanGuard

SRC = torch.tensor([0, 1, 2, 3, 4, 5, 1, 2, 0, 5, 3, 4])
DST = torch.tensor([1, 2, 3, 4, 5, 0, 0, 1, 2, 3, 4, 5])


class GAT(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.att = nn.Parameter(torch.randn(16) * 0.3)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h = self.lin(x)
        scores = F.leaky_relu(torch.cat([h[SRC], h[DST]], -1) @ self.att, 0.2)
        e = scores.exp()  # LINE: exp
        alpha = e / scatter(e, DST, dim=0, dim_size=x.shape[0], reduce="sum")[DST]
        return self.out(scatter(alpha[:, None] * h[SRC], DST, dim=0, dim_size=x.shape[0])).squeeze(-1)


def run(kind, folder=None, f64=False):
    torch.manual_seed(0)
    model = GAT().to(torch.float64 if f64 else torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder) if folder else None
    out = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
        if step == 2:
            x[2] = -400.0 * x[2].sign()  # a raw count feature on one node: a score beyond exp's range
        x, y = x.to(model.out.weight.dtype), y.to(model.out.weight.dtype)
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if guard:
            if not guard.step(loss):
                break
            continue
        loss.backward()
        norm = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
        out.append((loss.item(), norm.item()))
        if torch.isfinite(loss) and torch.isfinite(norm):
            opt.step()
    return guard.last_snapshot if guard else out


if __name__ == "__main__":
    if sys.argv[1] in ("--plain", "--f64"):
        print(json.dumps({k: run(k, f64=sys.argv[1] == "--f64") for k in sys.argv[2:]}))
    else:
        for kind in sys.argv[2:]:
            print(kind, run(kind, f"{sys.argv[1]}/{kind}"))
'''

ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.mark.integrations  # a loop trained, analyzed and retrained in subprocesses
def test_segment_softmax_fix_is_an_applied_edit_of_the_exp_line(tmp_path):
    pytest.importorskip("torch_geometric")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "segedit.py").write_text(TRAINING)
    res = subprocess.run([sys.executable, "segedit.py", str(tmp_path), "gat"], cwd=proj, capture_output=True,
                         text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    path = next(ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("gat "))
    d = analyze_isolated([path], tmp_path / "elsewhere", also_blocked=("segedit", "torch_geometric"))[path]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "exp")
    diag = d["diagnosis"]
    assert diag["cause"] == "segment_softmax", (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["kind"] == "max_subtraction" and fix["verified"] is True, fix["verification"]
    assert fix["tested_as"] == "op" and len(fix["edits"]) == 1, fix
    assert fix["before"].startswith("e = scores.exp()")
    assert fix["after"].startswith('e = (scores - scatter(scores.detach(), DST, dim=0, dim_size=x.shape[0], '
                                   "reduce='max')[DST]).exp()"), fix["after"]
    apply_and_train(tmp_path / "fixed", TRAINING, "segedit", "gat", fix, bad=2, env=ENV)


@pytest.mark.parametrize(("line", "want"), [
    ('a = e / scatter(e, dst, dim=0, reduce="sum")[dst]', "scatter((s * 2).detach(), dst, dim=0, reduce='max')[dst]"),
    ("a = e / pyg.scatter(e, dst)[dst]", "pyg.scatter((s * 2).detach(), dst, reduce='max')[dst]"),
    ("a = e / scatter(e, dst)", "scatter((s * 2).detach(), dst, reduce='max').index_select(0, dst)"),
    ('a = e / scatter(e, dst, reduce="mean")[dst]', None),  # not a sum: not a softmax's normaliser
    ("a = e / scatter(other, dst)[dst]", None),  # not the numerator's sum
    ("a = e / scatter(e, dst, 1)", None),  # gathered back along another dim: no edit we could be sure of
])
def test_the_segment_max_is_spelled_from_the_users_own_scatter(line, want):
    import ast

    from nanreplay.diagnose.edits import codefix, segfix

    parsed = codefix._Parsed(ast.parse(line), line, 1)
    div = parsed.tree.body[0].value
    assert segfix._segment_max_text(codefix.source_of_nodes(parsed), div, "s * 2") == want
