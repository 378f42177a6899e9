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
import torch.nn.functional as F
from isolation import guard_invisible

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


class Curriculum(nn.Module):
    """Python state the forward changes: a call counter a schedule reads, a list it appends to, a cache it
    reassigns (a tensor attribute, not a buffer)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 1)
        self.calls = 0
        self.seen: list[int] = []
        self.cache = torch.zeros(0, 16)

    def forward(self, x):
        self.calls += 1
        self.seen.append(x.shape[0])
        h = torch.relu(self.a(x)) * (1.0 + 0.01 * self.calls)
        self.cache = torch.cat([self.cache, h.detach()[:1]])[-4:]
        return self.b(h + self.cache.mean(0))


def _curriculum(folder, guarded: bool):
    torch.manual_seed(0)
    model = Curriculum()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder, spike_factor=5.0) if guarded else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(12):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        if step == 8:
            x = x * 1e4  # a finite gradient spike: snapshots are written, and training goes on
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        assert guard is None or guard.loss_ok(loss)
        loss.backward()
        assert guard is None or guard.grads_ok()
        opt.step()
        losses.append(loss.detach().clone())
    return losses, model, guard


def test_a_forward_with_python_state_is_not_run_ahead_by_a_spike_snapshot(tmp_path):
    """Before, each spike snapshot's re-run of the step counted one more call (and appended to the list), so
    every step after the first spike computed with another scale than the unguarded run."""
    plain, m0, _ = _curriculum(tmp_path / "off", False)
    guarded, m1, guard = _curriculum(tmp_path / "on", True)
    assert guard.spike_snapshots  # the re-runs happened
    assert (m1.calls, m1.seen) == (m0.calls, m0.seen) == (12, [8] * 12)
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded, strict=True))
    assert torch.equal(m0.cache, m1.cache)
    assert all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters(), strict=True))


class DoublePairs(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, a, b):
        return ((self.enc(a) - self.enc(b)) ** 2).sum(-1).sqrt().mean()  # LINE: double


def test_a_float64_model_is_guarded_and_analyzed(tmp_path):
    """Before, `grads_ok()` raised into the loop on every step of a float64 model (`model.double()`, physics and
    scientific code): the guard's norm asked torch for a float32 norm of float64 gradients, which it refuses."""
    def train(folder, guarded, bad):
        torch.manual_seed(0)
        model = DoublePairs().double()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        guard = NanGuard(model, opt, folder=folder) if guarded else None
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(4):
            a = torch.randn(4, 6, generator=g, dtype=torch.float64)
            b = a + 0.1 * torch.randn(4, 6, generator=g, dtype=torch.float64)
            if step == bad:
                b[1] = a[1]
            if guard:
                guard.begin((a, b), step=step)
            opt.zero_grad()
            loss = model(a, b)
            if guard and not guard.loss_ok(loss):
                break
            loss.backward()
            if guard and not guard.grads_ok():
                break
            opt.step()
            losses.append(loss.detach().clone())
        return losses, guard

    plain, _ = train(tmp_path / "off", False, None)
    guarded, guard = train(tmp_path / "on", True, None)
    assert len(guarded) == 4 and all(torch.equal(x, y) for x, y in zip(plain, guarded, strict=True))
    _, guard = train(tmp_path / "bad", True, 2)
    assert guard.last_snapshot and "_step000002_gradient_" in guard.last_snapshot
    result = analyze(guard.last_snapshot, verify=False).to_json()
    c = result["culprit"]
    assert (result["verdict"], c["forward_op"], c["kind"]) == ("culprit_found", "aten.sqrt.default", "inf")
    assert c["source"]["code"].endswith("# LINE: double")


def test_loss_ok_takes_a_number_or_per_sample_losses_without_raising(tmp_path):
    """`guard.loss_ok(loss.item())` and `guard.loss_ok(per_sample_losses)` (reduction="none") raised into the loop
    (AttributeError / ValueError). A number is checked as it is; per-sample losses fail when any is non-finite."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, check_flow=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    guard.begin(x, y, step=0)
    loss = F.mse_loss(model(x), y)
    assert guard.loss_ok(loss.item()) is True
    guard.begin(x, y, step=1)
    per_sample = F.mse_loss(model(x), y, reduction="none")
    assert guard.loss_ok(per_sample) is True and guard.last_snapshot is None
    y_bad = y.clone()
    y_bad[3] = 1e30  # one sample's squared error overflows
    guard.begin(x, y_bad, step=2)
    per_sample = F.mse_loss(model(x), y_bad, reduction="none")
    assert guard.loss_ok(per_sample) is False
    assert guard.last_snapshot and "_step000002_loss_" in guard.last_snapshot
    guard.begin(x, y_bad, step=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert guard.loss_ok(F.mse_loss(model(x), y_bad).item()) is False
    result = analyze(guard.last_snapshot, verify=False).to_json()  # the number's step, recorded with loss_fn
    assert result["verdict"] == "culprit_found" and result["culprit"]["module"] == "<loss>"


def test_an_update_that_breaks_a_complex_weight_is_caught_and_analyzed(tmp_path):
    """The check after optimizer.step() looked at floating weights only: a complex weight an infinite learning
    rate broke went unseen (and, once seen, its record could not be counted: `isposinf` takes no complex)."""
    torch.manual_seed(0)
    model = ComplexPairs()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, folder=tmp_path, check_flow=False)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        a, b = _reals(g), _reals(g)
        if step == 2:
            opt.param_groups[0]["lr"] = float("inf")
        guard.begin((a, b), step=step)
        loss = model(a, b)
        assert guard.loss_ok(loss)
        loss.backward()
        assert guard.grads_ok()
        opt.step()
        opt.zero_grad()
        if not guard.update_ok():
            break
    assert step == 2 and guard.last_snapshot and "_step000002_update_" in guard.last_snapshot
    result = analyze(guard.last_snapshot, verify=False).to_json()
    assert result["diagnosis"]["cause"] == "nonfinite_lr"


class LogFeature(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(7, 16), nn.Linear(16, 3)

    def forward(self, x):
        feat = torch.log(x.pow(2).sum(-1, keepdim=True))  # LINE: lbfgs
        return self.b(torch.tanh(self.a(torch.cat([x, feat], -1))))


def _lbfgs(folder, guarded: bool, bad: int | None):
    torch.manual_seed(0)
    model = LogFeature()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=folder) if guarded else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        if step == bad:
            x[1] = 0.0  # log(0) in a feature: the loss stays finite, a.weight's gradient is NaN
        if guard:
            guard.begin(x, y, step=step)
        ok = [True]

        def closure(x=x, y=y, ok=ok):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            ok[0] = ok[0] and (guard is None or guard.loss_ok(loss))
            loss.backward()
            ok[0] = ok[0] and (guard is None or guard.grads_ok())
            return loss

        losses.append(opt.step(closure).detach().clone())  # LBFGS calls the closure up to 5 times per step
        if not ok[0] or (guard and not guard.update_ok()):
            break
    return losses, model, guard


def test_lbfgs_closure_writes_one_snapshot_per_failing_batch(tmp_path):
    """LBFGS evaluates its closure several times per step and cannot be stopped inside it: after the closure's
    grads_ok() wrote the gradient snapshot, LBFGS stepped on the NaN gradient and called the closure again, and the
    guard wrote a loss snapshot and an update snapshot of the same step, both of already-NaN weights ("NaN/Inf already
    in the weights"): the last snapshot, the one a user opens, no longer named the culprit, and one incident used up
    max_snapshots=3. Now a batch (one begin()) writes one failure snapshot; what follows from it is one warning."""
    plain, m0, _ = _lbfgs(tmp_path / "off", False, None)
    guarded, m1, guard = _lbfgs(tmp_path / "on", True, None)
    assert len(plain) == len(guarded) == 3 and all(torch.equal(a, b) for a, b in zip(plain, guarded, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters(), strict=True))
    assert guard.last_snapshot is None

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, guard = _lbfgs(tmp_path / "bad", True, bad=2)
    assert len(guard.snapshots) == 1 and "_step000002_gradient_" in guard.snapshots[0], guard.snapshots
    assert guard.last_snapshot == guard.snapshots[0]
    assert sum("already written for this batch" in str(w.message) for w in caught) == 1
    result = analyze(guard.last_snapshot, verify=False).to_json()
    c = result["culprit"]
    assert (result["verdict"], c["forward_op"]) == ("culprit_found", "aten.log.default")
    assert c["source"]["code"].endswith("# LINE: lbfgs")


def test_an_update_snapshot_of_another_optimizer_lists_each_broken_weight_once(tmp_path):
    """An update snapshot of an optimizer whose step nanreplay does not invert (RMSprop, Adafactor, LBFGS) holds the
    weights after the update; the analysis listed each broken weight twice (once from the update's record, once as
    a weight the snapshot holds), and the report printed the parameter twice."""
    torch.manual_seed(0)
    model = LogFeature()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=tmp_path, check_flow=False)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        if step == 2:
            opt.param_groups[0]["lr"] = 3e38  # finite in float32; grad / sqrt(v) ~ 10 overflows the update
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        assert guard.loss_ok(loss)
        loss.backward()
        assert guard.grads_ok()
        opt.step()
        if not guard.update_ok():
            break
    assert step == 2 and guard.last_snapshot and "_step000002_update_" in guard.last_snapshot
    result = analyze(guard.last_snapshot, verify=False).to_json()
    names = [(r["name"], r["role"]) for r in result["nonfinite_leaves"]]
    assert result["verdict"] == "nonfinite_parameters" and names and len(names) == len(set(names)), names


class TiedMaxNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mix = nn.Embedding(20, 8, max_norm=1.0), nn.Linear(8, 8)

    def forward(self, ids):
        return torch.tanh(self.mix(self.emb(ids))) @ self.emb.weight.t()  # the output projection tied to the input


def _tied_step(model, batch):
    ids, y = batch
    return F.cross_entropy(model(ids).flatten(0, 1), y.flatten())


def _tied(folder, guarded: bool, bad: int | None):
    torch.manual_seed(0)
    model = TiedMaxNorm()
    with torch.no_grad():
        model.emb.weight.mul_(3)  # rows above max_norm: every forward renormalises the ones it reads, in place
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, step_fn=_tied_step, folder=folder) if guarded else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(3):
        batch = (torch.randint(0, 20, (2, 5), generator=g), torch.randint(0, 20, (2, 5), generator=g))
        if step == bad:
            with torch.no_grad():
                model.mix.weight[0, 0] = float("nan")
        if guard:
            guard.begin(batch, step=step)
        opt.zero_grad()
        loss = _tied_step(model, batch)
        if guard and not guard.loss_ok(loss):
            break
        loss.backward()
        if guard and not guard.grads_ok():
            break
        opt.step()
        losses.append(loss.detach().clone())
    return losses, model, guard


def test_an_embedding_with_max_norm_is_not_written_by_a_rerun(tmp_path):
    """`nn.Embedding(max_norm=...)` renormalises its weight in place in every forward (`embedding_renorm_`). The
    guard's first-step check of a `step_fn` re-ran the forward, whose renorm wrote the live weight (a version bump),
    and the loop's backward raised "modified by an inplace operation" because the tied output projection had saved
    that weight. A failing step could not be recorded either (`embedding_renorm_` is not a pure op). The re-runs now
    skip the renorm: the loop's forward already renormalised every row the batch reads."""
    plain, m0, _ = _tied(tmp_path / "off", False, None)
    guarded, m1, guard = _tied(tmp_path / "on", True, None)
    assert len(plain) == len(guarded) == 3 and all(torch.equal(a, b) for a, b in zip(plain, guarded, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters(), strict=True))
    _, _, guard = _tied(tmp_path / "bad", True, bad=2)
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap["program_error"] is None
    result = analyze(guard.last_snapshot, verify=False).to_json()
    assert result["verdict"] == "nonfinite_parameters" and result["nonfinite_leaves"][0]["name"] == "mix.weight"


class PackedTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(30, 8), nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 3)

    def forward(self, ids, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
        h, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        pooled = h[:, 1:].sum(1) / (lengths[:, None] - 1).to(h.dtype)  # LINE: packed
        return self.out(pooled)


def test_a_packed_sequence_step_is_recorded_and_analyzed(tmp_path):
    """`pack_padded_sequence` before an RNN (`_pack_padded_sequence`) was not on the allowlist: every snapshot of such
    a step needed --model. Now it is, with its lengths checked against the input's length (the kernel reads that
    many time steps unchecked), and the dry run bounds its data-dependent output."""
    def train(folder, guarded, bad):
        torch.manual_seed(0)
        model = PackedTagger()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=folder) if guarded else None
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(3):
            ids, y = torch.randint(1, 30, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g)
            lengths = torch.tensor([6, 4, 1 if step == bad else 5, 2])  # a one-token sample: 0 / 0
            if guard:
                guard.begin((ids, lengths), y, step=step)
            opt.zero_grad()
            loss = F.cross_entropy(model(ids, lengths), y)
            if guard and not guard.loss_ok(loss):
                break
            loss.backward()
            if guard and not guard.grads_ok():
                break
            opt.step()
            losses.append(loss.detach().clone())
        return losses, model, guard

    guard_invisible(train, tmp_path, 3)
    _, _, guard = train(tmp_path / "bad", True, 2)
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap["program_error"] is None
    result = analyze(guard.last_snapshot, verify=False).to_json()
    c = result["culprit"]
    assert (result["verdict"], c["forward_op"]) == ("culprit_found", "aten.div.Tensor"), result.get("warnings")
    assert c["source"]["code"].endswith("# LINE: packed")
