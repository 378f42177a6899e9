"""Runs whose snapshot needs its context: a history that diverged, a finite gradient spike, a step that
replays finite (another rank, a compiled model, a transient fault). Each comes from NanGuard in a real
training loop; where the run's setting cannot be had on one CPU process (a second rank, torch.compile),
the snapshot's `environment` says so, as the guard writes it."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import causes
from nanreplay import NanGuard, stats
from nanreplay.analysis import analyze
from nanreplay.diagnose.divergence import clip_value


def _train(folder: Path, model, opt, loss_fn, batch, steps: int, *, inject=None, **guard_kw) -> NanGuard:
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder, **guard_kw)
    for step in range(steps):
        x, y = batch(step)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        if inject == ("loss", step):
            loss = loss * float("nan")  # a bit flip: this step alone, not in the model
        if not guard.loss_ok(loss):
            break
        loss.backward()
        if inject == ("gradient", step):
            with torch.no_grad():
                model.fc1.weight.grad[0, 0] = float("nan")  # what another rank's gradient does to the average
        if not guard.grads_ok():
            break
        opt.step()
    return guard


def _edit(path: str, **top) -> str:
    """The snapshot as a run with that setting writes it: `environment` keys merged, other keys set."""
    d = torch.load(path, weights_only=True)
    d["environment"] = {**(d.get("environment") or {}), **top.pop("environment", {})}
    d.update(top)
    out = str(Path(path).with_name("edited_" + Path(path).name))
    torch.save(d, out)
    return out


def _analyze(path: str, model: str, loss: str) -> dict:
    return analyze(path, model=f"causes:{model}", loss=loss).to_json()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    gpt = causes.tiny_gpt()
    g = _train(root / "gpt", gpt, torch.optim.SGD(gpt.parameters(), lr=30.0), causes.lm_loss, causes.gpt_batch, 30)
    out["diverged"] = _analyze(g.last_snapshot, "tiny_gpt", "causes:lm_loss")
    m = causes.regressor()
    g = _train(root / "spike", m, torch.optim.SGD(m.parameters(), lr=0.01), F.mse_loss,
               lambda s: causes.regression_batch(s, outlier=s == 12), 14, spike_factor=5.0)
    out["spike"] = _analyze(g.spike_snapshots[0], "regressor", "mse_loss")
    for kind, inject in (("transient", ("loss", 6)), ("allreduce", ("gradient", 6))):
        m = causes.regressor()
        g = _train(root / kind, m, torch.optim.SGD(m.parameters(), lr=0.01), F.mse_loss, causes.regression_batch, 10,
                   inject=inject)
        out[kind] = g.last_snapshot
    out["allreduce"] = _analyze(_edit(out["allreduce"], rank=0, world_size=2,
                                      environment={"collective": {"op": "all_reduce", "nonfinite_ranks": [1]}}),
                                "regressor", "mse_loss")
    out["compiled"] = _analyze(_edit(out["transient"], environment={"compiled": True}), "regressor", "mse_loss")
    out["transient"] = _analyze(out["transient"], "regressor", "mse_loss")
    return out


def test_divergence_is_named_with_the_histories_numbers(runs):
    """A tiny GPT trained with lr = 30: the loss climbs 3.65 → 2.4e8, activations reach 1e21, and LayerNorm
    makes NaN (inf − inf). The diagnosis is "training diverged", its evidence the history, its fix the
    learning rate and clipping at the healthy steps' gradient norm."""
    d = runs["diverged"]
    assert d["verdict"] == "culprit_found" and d["culprit"]["op"] == "aten.native_layer_norm.default"
    assert d["culprit"]["source"]["line"] == causes.CASES.marker_line("diverged_gpt")
    diag = d["diagnosis"]
    assert diag["cause"] == "training_diverged" and diag["fix"]["kind"] == "lower_lr_clip_grads"
    rows = [r for r in d["snapshot_info"]["history"] if isinstance(r["loss"], float) and math.isfinite(r["loss"])]
    first, last = rows[0], rows[-1]
    assert last["loss"] > 1e4 * first["loss"]
    expl = diag["explanation"]
    assert expl.startswith("Training diverged:") and f"{first['loss']:.3g}" in expl and f"{last['loss']:.3g}" in expl
    assert "inf − inf" in expl and "restart from a checkpoint from before step" in expl
    div = diag["divergence"]
    healthy = [r["grad_norm"] for r in rows if r["step"] < div["onset_step"]]
    assert div["healthy_grad_norm"] == pytest.approx(statistics.median(healthy))
    assert f"max_norm={clip_value(statistics.median(healthy)):g}" in diag["fix"]["code"]
    assert div["lr_at_onset"] == pytest.approx(30.0) and div["clip"] is None  # lr 30, nothing clipped
    assert f"the climb began at step {div['onset_step']} with the learning rate at 30" in diag["fix"]["code"]
    assert diag["fix"]["verified"] is None and "not replayed" in diag["fix"]["verification"]
    assert diag["magnitude_origin"]["output_absmax"] > 1e19  # where the values became huge, told too
    assert "made huge by" in expl


def test_a_finite_spike_is_analyzed_as_a_spike(runs):
    """One sample 1000× too large at step 12: the guard writes a grad_spike snapshot (finite). The analysis
    says which parameters carry the spike, where backward grew it, and which sample stands out."""
    d = runs["spike"]
    assert d["snapshot_info"]["trigger"] == "grad_spike" and d["verdict"] == "not_reproduced"
    diag = d["diagnosis"]
    assert diag["cause"] == "grad_spike" and diag["title"] == "a finite gradient-norm spike"
    spike = diag["spike"]
    norms = {g["name"]: g for g in d["gradients"]}
    top = max(norms, key=lambda n: (norms[n]["max_abs"] or 0))
    assert spike["factor"] > 5 and spike["carriers"][0]["name"] == top and spike["carriers"][0]["share"] > 0.5
    assert sum(c["share"] for c in spike["carriers"]) == pytest.approx(1.0)
    assert spike["outlier_samples"][0]["samples"] == [3]
    assert spike["backward_growth"]["module"] in ("fc1", "fc2")
    assert spike["carrier_op"] == {**spike["carrier_op"], "op": "aten.addmm.default", "module": top.rpartition(".")[0]}
    expl = diag["explanation"]
    assert "spike" in expl and top in expl and "[3]" in expl and "not reproduced" not in expl.lower()
    assert diag["fix"]["kind"] == "lower_lr_clip_grads" and "max_norm=" in diag["fix"]["code"]


def test_nan_from_the_all_reduce_points_at_the_other_rank(runs):
    d = runs["allreduce"]
    diag = d["diagnosis"]
    assert d["verdict"] == "not_reproduced" and diag["cause"] == "nonfinite_from_allreduce"
    assert "not reproduced on this rank: the gradient came non-finite from the all-reduce; see rank 1" in \
        diag["explanation"].lower()
    assert diag["collective"]["nonfinite_ranks"] == [1]


def test_a_compiled_run_that_replays_finite(runs):
    diag = runs["compiled"]["diagnosis"]
    assert diag["cause"] == "compiled_numerics" and "compiled numerics differ" in diag["explanation"]
    assert "aot_eager" in diag["fix"]["code"]


def test_a_finite_rerun_of_the_same_state_is_a_likely_transient_fault(runs):
    d = runs["transient"]
    diag = d["diagnosis"]
    assert diag["cause"] == "transient_fault"
    # the guard's own re-run was finite too (its record, differential/machine.py): the title says what was seen
    assert d["differential"]["machine"]["verdict"] == "transient"
    assert diag["title"] == "transient fault: the same step re-run on the same device was finite"
    ev = " ".join(diag["evidence"])
    assert "same batch, weights and random state" in ev and "no torch.compile" in ev and "no collective" in ev
    assert "the run's loss was NaN" in ev and f"loss {stats.num(d['loss'])}" in ev  # as prose writes numbers
