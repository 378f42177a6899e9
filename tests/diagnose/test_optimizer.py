"""Failures inside optimizer.step(), end to end: a real loop breaks its weights in the update, NanGuard writes the
update snapshot at that step, and the analysis replays the update under the Recorder — the culprit op inside
torch.optim, the cause, the fix and its verification by replaying the update with it (finite and plausible).
And the late path: a snapshot written one step after the update names that update and its most likely cause.
"""

from __future__ import annotations

import json

import optimizer_loops as L
import pytest
import torch
from click.testing import CliRunner

from nanreplay.analysis import analyze
from nanreplay.analysis import update as update_analysis
from nanreplay.cli import main
from nanreplay.formats import load
from nanreplay.replay.update import try_update


def _analyzed(run: L.Run) -> dict:
    assert run.trigger == "update", f"the guard did not catch the update (trigger {run.trigger})"
    d = analyze(run.guard.last_snapshot).to_json()
    json.dumps(d, allow_nan=False)  # strict JSON
    return d


def _verified(fix: dict) -> None:
    assert fix["verified"] is True, fix["verification"]
    assert fix["replay"]["plausible"] is True and fix["replay"]["ratio"] <= 0.5
    assert "every weight finite" in fix["verification"]


def test_half_adam_default_eps(tmp_path):
    run = L.half_adam(tmp_path)
    assert run.step == 0
    d = _analyzed(run)
    c = d["culprit"]
    assert d["verdict"] == "culprit_found" and c["phase"] == "optimizer" and c["module"] == "<optimizer>"
    assert c["op"] == "aten.addcdiv_.default" and c["role"] == "origin"
    assert c["source"]["file"].endswith("adam.py") and "addcdiv_" in c["source"]["code"]
    assert d["failure"]["what"] == "parameter" and d["failure"]["name"] == "0.weight"
    u = c["update"]
    assert u["parameter"] == "0.weight" and u["eps_in_dtype"] == {"dtype": "float16", "value": 0.0}
    assert u["entries"] > 0 and u["at_entries"]["state.exp_avg_sq"]["zeros"] == u["entries"]
    assert c["inputs"][2]["zeros"] >= u["entries"]  # the denominator the op divided by
    diag = d["diagnosis"]
    assert diag["cause"] == "optimizer_eps" and "rounds to 0" in diag["explanation"]
    assert diag["fix"]["kind"] == "optimizer_eps" and diag["fix"]["epsilon"] >= 1e-4
    assert f"eps={diag['fix']['epsilon']:g}" in diag["fix"]["code"]
    _verified(diag["fix"])
    # the replayed update reproduces exactly what training saw, entry for entry
    assert d["update"]["reproduced"] and d["update"]["pre_step"] == "reconstructed"
    assert d["update"]["step_program"]["replayed"] is True
    assert d["anomaly_mode"]["raises"] is None


def test_half_adam_on_the_foreach_path(tmp_path):
    d = _analyzed(L.half_adam(tmp_path, foreach=True))
    assert d["culprit"]["op"].startswith("aten._foreach_addcdiv_") and d["culprit"]["phase"] == "optimizer"
    assert d["update"]["implementation_replayed"] == "foreach"
    assert d["diagnosis"]["cause"] == "optimizer_eps"
    _verified(d["diagnosis"]["fix"])


def test_half_adam_with_an_exact_copy(tmp_path):
    d = _analyzed(L.half_adam(tmp_path, keep_pre_step=True))
    assert d["update"]["pre_step"] == "copied" and d["update"]["reproduced"]
    sp = d["update"]["step_program"]
    assert sp["gradients_equal"] is True and sp["loss"] == sp["loss_recorded"]  # the step program, bit for bit
    assert d["diagnosis"]["cause"] == "optimizer_eps"


def test_float32_master_weights_verify_too(tmp_path):
    """The other optimizer_eps fix: keep float32 weights (autocast for the forward). Replayed: finite, sane."""
    run = L.half_adam(tmp_path)
    us = update_analysis.subject(load(run.guard.last_snapshot), None)
    t = try_update(us, "in float32", dtype=torch.float32)
    assert t.ok and t.replay["max_abs_update"] <= 1.01e-3  # Adam's step is lr per entry at step 1
    assert not try_update(us, "with eps=1e-8", hyper={"eps": 1e-8}).ok


def test_lr_that_overflows_half_weights(tmp_path):
    run = L.half_sgd_overflow(tmp_path)
    assert run.step == 0
    d = _analyzed(run)
    c = d["culprit"]
    assert c["phase"] == "optimizer" and c["op"] == "aten.add_.Tensor" and c["kind"] == "inf"
    assert c["source"]["file"].endswith("sgd.py")
    diag = d["diagnosis"]
    assert diag["cause"] == "update_overflow" and "65504" in diag["explanation"].replace("6.55e+04", "65504")
    assert diag["fix"]["kind"] == "lower_lr_clip_grads" and "lr=" in diag["fix"]["code"]
    _verified(diag["fix"])


def test_nan_momentum_state(tmp_path):
    run = L.nan_momentum(tmp_path)
    assert run.step == 3
    d = _analyzed(run)
    c = d["culprit"]
    assert c["phase"] == "optimizer" and c["op"] == "aten.mul_.Tensor" and c["kind"] == "nan"
    assert c["update"]["parameter"] == "0.weight" and c["update"]["entries"] == 3
    assert {r["name"]: r["role"] for r in d["nonfinite_leaves"]} == {"0.weight:momentum_buffer": "optimizer_state"}
    diag = d["diagnosis"]
    assert diag["cause"] == "nonfinite_optimizer_state" and "momentum_buffer of 0.weight (3 NaN" in diag["explanation"]
    assert diag["fix"]["kind"] == "restore_optimizer_state" and "'0.weight'" in diag["fix"]["code"]
    _verified(diag["fix"])


def test_scheduler_that_returns_inf(tmp_path):
    run = L.inf_schedule(tmp_path)
    assert run.step == 3
    d = _analyzed(run)
    assert d["culprit"]["phase"] == "optimizer" and d["culprit"]["op"] == "aten.add_.Tensor"
    diag = d["diagnosis"]
    assert diag["cause"] == "nonfinite_lr" and "LambdaLR" in diag["explanation"]
    assert diag["fix"]["kind"] == "lr_schedule" and "lr = 0.1" in diag["fix"]["verification"]
    # the lambda clamped where the LambdaLR is made (the loop's file is on the stack when the guard writes)
    assert "max(0.0, min(1.0, _f(s)))" in diag["fix"]["after"] and diag["fix"]["edits"][0]["line"] >= 1
    _verified(diag["fix"])
    assert d["update"]["pre_step"] == "copied" and d["update"]["step_program"]["gradients_equal"] is True


def test_late_snapshot_names_the_update_and_its_cause(tmp_path):
    """Without the update check the guard fires one step late, on the NaN loss: the analysis still says which
    update broke which weights, and — from the Adam state the snapshot holds — why."""
    run = L.half_adam(tmp_path, check_update=False)
    assert (run.trigger, run.step) == ("loss", 1)
    d = analyze(run.guard.last_snapshot).to_json()
    assert d["verdict"] == "nonfinite_parameters"
    diag = d["diagnosis"]
    assert diag["cause"] == "optimizer_eps" and diag["late"] is True
    assert "previous Adam update" in diag["explanation"] and "0.weight: 290 of 512 entries" in diag["explanation"]
    assert "exp_avg_sq is 0" in diag["explanation"]
    assert diag["fix"]["kind"] == "optimizer_eps" and diag["fix"]["verified"] is None
    assert "capture with NanGuard so the first bad step" not in diag["explanation"]


def test_late_snapshot_of_a_broken_schedule(tmp_path):
    run = L.inf_schedule(tmp_path, check_update=False)
    assert run.trigger == "loss"
    diag = analyze(run.guard.last_snapshot).to_json()["diagnosis"]
    assert diag["cause"] == "nonfinite_lr" and "lr = inf" in diag["explanation"]


def test_cli_analyze_and_report(tmp_path):
    run = L.half_adam(tmp_path)
    out = tmp_path / "r.html"
    res = CliRunner().invoke(main, ["analyze", run.guard.last_snapshot, "-o", str(out), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    assert "(optimizer)" in res.output and "the weight 0.weight became Inf in the update" in res.output
    assert "optimizer_eps" in out.read_text()
    assert json.loads((tmp_path / "r.json").read_text())["culprit"]["phase"] == "optimizer"


OPTIMIZER_CAUSES = ("nonfinite_lr", "nonfinite_optimizer_state", "optimizer_eps", "update_overflow",
                    "optimizer_kernel_path", "optimizer_update")


def test_optimizer_rules_come_first_and_never_claim_a_forward_culprit(analyzed, monkeypatch):
    from nanreplay import diagnose

    sites = []
    real = diagnose.diagnose

    def spy(result, subject, step, c, chain, **kw):
        sites.append(diagnose.Site(step, step.events[c], chain, subject))
        return real(result, subject, step, c, chain, **kw)

    monkeypatch.setattr(diagnose, "diagnose", spy)
    analyzed("log_zero", verify=False)
    (site,) = sites
    order = [r.cause for r in diagnose.RULES]
    assert tuple(order[:len(OPTIMIZER_CAUSES)]) == OPTIMIZER_CAUSES
    for r in diagnose.RULES:
        if r.cause in OPTIMIZER_CAUSES:
            assert r.fn(site) is None, r.cause


def test_a_foreach_kernel_that_differs_from_the_reference(tmp_path, monkeypatch):
    """A (simulated) faulty foreach kernel: it writes NaN where the single-tensor path computes a finite update.
    The analysis replays both paths and blames the kernel path; foreach=False verifies."""
    real = torch._foreach_addcdiv_

    def faulty(params, *args, **kwargs):
        real(params, *args, **kwargs)
        params[0].view(-1)[:2] = float("nan")
    monkeypatch.setattr(torch, "_foreach_addcdiv_", faulty)
    model = L.mlp()
    run = L.train(model, torch.optim.Adam(model.parameters(), foreach=True), tmp_path, steps=2)
    d = _analyzed(run)
    assert d["culprit"]["phase"] == "optimizer" and d["update"]["implementation_replayed"] == "foreach"
    diag = d["diagnosis"]
    assert diag["cause"] == "optimizer_kernel_path"
    assert diag["fix"]["kind"] == "optimizer_implementation" and "foreach=False" in diag["fix"]["code"]
    _verified(diag["fix"])


def test_only_torch_optim_classes_are_rebuilt_by_name(tmp_path):
    """The optimizer comes back from its recorded class name, for torch.optim's own classes only: a snapshot that
    names anything else (or a module path) is refused with one clear line, and nothing is imported."""
    from nanreplay.errors import ReplayError

    run = L.half_adam(tmp_path)
    d = torch.load(run.guard.last_snapshot, weights_only=True)
    for name in ("LBFGS", "os.system", "Optimizer"):
        d["update"]["class"] = name
        d["update"]["qualname"] = "evil_module.Evil"
        path = tmp_path / f"{name}.pt"
        torch.save(d, path)
        with pytest.raises(ReplayError, match="only torch.optim's own"):
            analyze(str(path))
