"""Dense linear algebra in the step is recorded (found by the open-world audit): before, a model whose step ran a
factorisation or a solve — `torch.distributions.MultivariateNormal` (cholesky, a triangular solve, its argument
validation's `&=`), a normalizing flow's `slogdet`, whitening (`eigh`, `svdvals`, `qr`, `solve`, `inv`) — left a
snapshot with no step program ("needs --model"). Now each is a program, replayed bit for bit, and a culprit
inside the factorisation is named (a singular matrix's log-determinant)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from nanreplay import NanGuard
from nanreplay.analysis import analyze
from nanreplay.formats.dryrun import node_work


class GaussianHead(nn.Module):
    """A full-covariance Gaussian likelihood (MultivariateNormal with validation on: torch's default, but said
    explicitly, because torch._dynamo turns the default off for the whole process the first time anything compiles)."""

    def __init__(self):
        super().__init__()
        self.mu = nn.Linear(6, 3)
        self.cf = nn.Linear(6, 9)

    def forward(self, x, y):
        c = self.cf(x).view(-1, 3, 3)
        cov = c @ c.mT + 1e-3 * torch.eye(3)
        nll = -torch.distributions.MultivariateNormal(self.mu(x), covariance_matrix=cov, validate_args=True).log_prob(y).mean()
        return nll + torch.log(x[:, 0].abs()).mean()  # LINE: gaussian


class Whitening(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 4)

    def forward(self, x, y):
        h = self.proj(x)
        c = h.mT @ h / h.shape[0] + 1e-2 * torch.eye(4)
        e, v = torch.linalg.eigh(c)
        r = torch.linalg.qr(h)[1]
        out = ((h @ v / e.sqrt()) ** 2).mean() + r.abs().mean() + torch.linalg.svdvals(h).sum()
        out = out + torch.linalg.solve(c, h.mT).mean() + torch.linalg.inv(c).mean()
        return out + torch.log(x[:, 0].abs()).mean()  # LINE: whitening


class PairFlow(nn.Module):
    """The log-determinant of a 2x2 map the batch builds: a zero row makes it singular (log|det| = -inf)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x, y):
        a = self.scale * x[:, :4].reshape(-1, 2, 2)
        return -torch.linalg.slogdet(a)[1].mean() + (y ** 2).mean()  # LINE: flow


def _run(make, bad, folder):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = NanGuard(model, opt, folder=folder)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        if step == 2:
            bad(x)
        guard.begin((x, y), step=step)
        opt.zero_grad()
        loss = model(x, y)
        if not guard.loss_ok(loss):
            break
        loss.backward()
        if not guard.grads_ok():
            break
        opt.step()
    return guard


def _zero(x):
    x[1, 0] = 0.0


def _singular(x):
    x[1, 0:2] = 0.0  # a zero row: det exactly 0


CASES = {
    "gaussian": (GaussianHead, _zero, {"aten.linalg_cholesky_ex.default", "aten.linalg_solve_triangular.default",
                                       "aten.bitwise_and_.Tensor"}, "aten.log.default"),
    "whitening": (Whitening, _zero, {"aten._linalg_eigh.default", "aten.linalg_qr.default",
                                     "aten._linalg_svd.default", "aten._linalg_solve_ex.default",
                                     "aten.linalg_inv_ex.default"}, "aten.log.default"),
    "flow": (PairFlow, _singular, {"aten._linalg_slogdet.default"}, "aten._linalg_slogdet.default"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_with_linear_algebra_is_recorded_and_its_culprit_named(case, tmp_path):
    make, bad, ops, culprit_op = CASES[case]
    guard = _run(make, bad, tmp_path)
    assert guard.last_snapshot and "_step000002_loss_" in guard.last_snapshot
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap["program_error"] is None
    recorded = {n["op"] for n in json.loads(snap["step_program"])["nodes"]}
    assert ops <= recorded, ops - recorded
    result = analyze(guard.last_snapshot, verify=False).to_json()
    assert result["verdict"] == "culprit_found", result.get("warnings")
    c = result["culprit"]
    assert (c["phase"], c["op"]) == ("forward", culprit_op)
    assert c["source"]["code"].endswith(f"# LINE: {case}")


def test_the_dry_run_counts_a_factorisation_as_cubic_work():
    """A crafted 8000x8000 cholesky stored as a 4-byte expanded view: its elements alone (6.4e7) are far below
    the work bound; its n^3 multiply-adds (5e11) are what the kernel does, and what the bound must see."""
    a = torch.empty(8000, 8000, device="meta")
    assert node_work("aten.linalg_cholesky_ex.default", [a], [[[8000, 8000], "float32"], [[], "int32"]]) >= 8000 ** 3
    assert node_work("aten.relu.default", [a], [[[8000, 8000], "float32"]]) < 8000 ** 2 * 3
