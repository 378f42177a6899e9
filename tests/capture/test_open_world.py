"""The guard and the analysis on what real training hands them that a dense float32 model never does
(found by the open-world audit, docs/guard.md "Gradients that are not dense real tensors"):

* a sparse gradient (`nn.Embedding(sparse=True)`, with SparseAdam or SGD): `grads_ok()` raised into the loop
  (`linalg_vector_norm` / `isfinite` have no sparse kernel); the analysis crashed reading the replayed gradient;
* a complex parameter (`nn.Parameter(torch.randn(..., dtype=torch.cfloat))`, Adam and SGD): `grads_ok()` raised
  (a float32 norm of a complex tensor), the guard's re-run counted no non-finite entry, and the replay saw no
  op make the complex gradient non-finite ("not reproduced").

Each runs a few steps guarded and unguarded (bitwise equal, nothing raised), then a step whose gradient is
Inf (sqrt at zero: a duplicated pair), analyzed to its culprit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from nanreplay import NanGuard
from nanreplay.analysis import analyze


class SparsePairs(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.proj = nn.Linear(4, 3)

    def forward(self, a, b):
        d = self.proj(self.emb(a).mean(1)) - self.proj(self.emb(b).mean(1))
        return (d ** 2).sum(-1).sqrt().mean()  # LINE: sparse


class ComplexPairs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6, dtype=torch.cfloat) * 0.3)

    def forward(self, a, b):
        d = a.to(torch.cfloat) @ self.w - b.to(torch.cfloat) @ self.w
        return (d.abs() ** 2).sum(-1).sqrt().mean()  # LINE: complex


def _ids(g):
    return torch.randint(0, 20, (4, 5), generator=g)


def _reals(g):
    return torch.randn(4, 6, generator=g)


CASES = {
    "sparse_sparseadam": (SparsePairs, _ids, lambda m: torch.optim.SparseAdam(list(m.emb.parameters()), lr=0.01)),
    "sparse_sgd": (SparsePairs, _ids, lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)),
    "complex_adam": (ComplexPairs, _reals, lambda m: torch.optim.Adam(m.parameters(), lr=0.01)),
}


def _train(case: str, folder, guarded: bool, bad_step: int | None):
    make, batch, opt = CASES[case]
    torch.manual_seed(0)
    model = make()
    optimizer = opt(model)
    guard = NanGuard(model, optimizer, folder=folder, check_flow=False) if guarded else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(4):
        a, b = batch(g), batch(g)
        if step == bad_step:
            b = b.clone()
            b[1] = a[1]  # a duplicated pair: distance 0, sqrt's gradient Inf
        if guard:
            guard.begin((a, b), step=step)
        optimizer.zero_grad()
        loss = model(a, b)
        if guard and not guard.loss_ok(loss):
            break
        loss.backward()
        if guard and not guard.grads_ok():
            break
        optimizer.step()
        if guard and not guard.update_ok():
            break
        losses.append(loss.detach().clone())
    return losses, model, guard


@pytest.mark.parametrize("case", sorted(CASES))
def test_sparse_and_complex_gradients_train_and_analyze(case, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the guard warns when it cannot check: none here
        plain, m0, _ = _train(case, tmp_path / "off", False, None)
        guarded, m1, guard = _train(case, tmp_path / "on", True, None)
    assert len(plain) == len(guarded) == 4 and all(torch.equal(x, y) for x, y in zip(plain, guarded, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters(), strict=True))
    assert guard.last_snapshot is None

    _, _, guard = _train(case, tmp_path / "bad", True, bad_step=2)
    assert guard.last_snapshot and "_step000002_gradient_" in guard.last_snapshot
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap["program_error"] is None and snap["rerun"]["training"]["grads_nonfinite"] > 0
    result = analyze(guard.last_snapshot).to_json()
    assert result["verdict"] == "culprit_found", result.get("warnings")
    c = result["culprit"]
    assert (c["phase"], c["forward_op"], c["kind"]) == ("backward", "aten.sqrt.default", "inf")
    assert c["source"]["code"].endswith(f"# LINE: {case.split('_')[0]}")
    assert result["diagnosis"]["cause"] == "sqrt_at_zero"
    # the fix replayed, and judged against a float64 replay of the step (complex weights in complex128)
    assert result["diagnosis"]["fix"]["verified"] is True, result["diagnosis"]["fix"]["replay"]
