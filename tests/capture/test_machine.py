"""The machine (#31.3): the guard's in-process re-run beside the training step, and the verdict it gives.

A bit flipped in one activation of one training step (tests/machines.py) is what a transient fault of the machine
leaves: the guard's re-run of that step is finite, so the verdict is `transient` and the diagnosis says so; a NaN the
step itself makes is `reproducible`; a re-run that drew other random numbers (its own generator) is `inconclusive`.
"""

from __future__ import annotations

import math

import pytest
import torch
from clirun import one_line_error, run
from machines import DropoutNet, Net, train

from nanreplay import formats
from nanreplay.analysis import analyze
from nanreplay.differential import machine
from nanreplay.errors import GuardError
from nanreplay.report.markdown import markdown_summary
from nanreplay.report.terminal import terminal_summary


def _machine(a) -> dict:
    return a.differential["machine"]


def test_a_bit_flipped_in_one_training_step_is_a_transient_fault(tmp_path):
    path, hook = train(tmp_path / "snaps", flip_at=3, identity={"host": "host-17", "device": "cuda:3"})
    assert path is not None and hook.flipped == 1  # the training step's forward only: the re-run was clean
    raw = torch.load(path, weights_only=True)
    rec = raw["rerun"]
    assert rec["training"]["loss_finite"] is False and rec["rerun"]["loss_finite"] is True
    assert rec["training"]["loss_hash"] != rec["rerun"]["loss_hash"] and rec["random_count"] == 0
    assert raw["machine"]["host"] == "host-17" and raw["machine"]["device"] == "cuda:3"
    a = analyze(path)
    m = _machine(a)
    assert m["verdict"] == "transient" and m["skipped"] is None
    assert "re-run in the same process on cuda:3 on host-17, was finite" in m["sentence"]
    assert [r["what"] for r in m["ran"]] == ["training step", "guard's re-run (same process, same device)",
                                             "analysis replay"]
    replayed = m["ran"][2]["loss"]
    assert math.isclose(replayed, m["ran"][1]["loss"], rel_tol=1e-4)  # the analysis replays the clean re-run
    assert a.diagnosis["cause"] == "transient_fault" and "same device was finite" in a.diagnosis["title"]
    d = a.to_json()
    assert "machine  transient: the same step, re-run" in terminal_summary(d, None)
    assert "**Machine:** Transient" in markdown_summary(d)


def test_a_gradient_corrupted_in_backward_is_transient_and_the_gradient_hashes_differ(tmp_path):
    path, hook = train(tmp_path / "snaps", flip_at=2, grad_flip=True)
    assert hook.flipped == 1
    raw = torch.load(path, weights_only=True)
    assert raw["trigger"] == "gradient"
    rec = raw["rerun"]
    assert rec["comparable"]["grads"] is True  # one micro-batch, no scaler, the guard's own norm
    assert rec["training"]["grads_nonfinite"] > 0 and rec["rerun"]["grads_nonfinite"] == 0
    assert rec["training"]["loss_hash"] == rec["rerun"]["loss_hash"]  # the forward was not touched: same bits
    assert rec["training"]["grads_hash"] != rec["rerun"]["grads_hash"]
    a = analyze(path)
    assert _machine(a)["verdict"] == "transient" and _machine(a)["bitwise_equal"] is False
    assert a.diagnosis["cause"] == "transient_fault"


def test_a_nan_the_step_makes_is_reproducible_bit_for_bit(tmp_path):
    path, _ = train(tmp_path / "snaps", model=Net(log=True))
    raw = torch.load(path, weights_only=True)
    assert raw["rerun"]["training"]["loss_hash"] == raw["rerun"]["rerun"]["loss_hash"]
    a = analyze(path)
    m = _machine(a)
    assert m["verdict"] == "reproducible" and m["bitwise_equal"] is True
    assert a.culprit is not None  # a plain culprit: the machine line stays off the first screen
    assert "  machine  " not in terminal_summary(a.to_json(), None)


def test_dropout_from_an_unrecorded_generator_is_inconclusive(tmp_path):
    torch.manual_seed(0)
    path, _ = train(tmp_path / "snaps", flip_at=3, model=DropoutNet())
    raw = torch.load(path, weights_only=True)
    rec = raw["rerun"]
    assert rec["random_unrecorded"] >= 1 and rec["random_ops"][0]["generator"] == "own generator"
    assert rec["rerun"]["loss_finite"] is True  # the re-run ran even though the step cannot be a program
    m = machine.analyze(formats.load(path).raw)
    assert m["verdict"] == "inconclusive" and "generator the guard did not record" in m["sentence"]
    a = analyze(path, model="machines:dropout_net")  # the eager replay: the verdict reaches the diagnosis
    assert _machine(a)["verdict"] == "inconclusive"
    assert "not the same computation" in a.diagnosis["explanation"]


def test_a_snapshot_without_the_record_is_skipped_with_the_reason(tmp_path):
    path, _ = train(tmp_path / "snaps", flip_at=3)
    raw = dict(formats.load(path).raw)
    del raw["rerun"]
    m = machine.analyze(raw)
    assert m["verdict"] == "skipped" and "no record of the guard's re-run" in m["skipped"]
    assert machine.analyze(raw, culprit_found=True) is None  # a plain culprit: the question does not arise


@pytest.mark.parametrize("field, value, words", [
    ("rerun", {"training": {"loss": "0.5"}}, "rerun.training.loss must be a number"),
    ("rerun", {"random_ops": 3}, "rerun.random_ops must be a list"),
    ("rerun", {"deterministic": {"algorithms": "yes"}}, "rerun.deterministic.algorithms must be true or false"),
    ("machine", {"host": 17}, "machine.host must be a string"),
])
def test_crafted_record_fields_are_one_line(tmp_path, field, value, words):
    path, _ = train(tmp_path / "snaps", flip_at=1, steps=2)
    d = torch.load(path, weights_only=True)
    d[field] = value
    torch.save(d, tmp_path / "crafted.pt")
    one_line_error(run("analyze", tmp_path / "crafted.pt", "-o", tmp_path / "r.html", "--no-confine"), 2, words)


def test_the_identity_option_is_checked_when_the_guard_is_made():
    with pytest.raises(GuardError, match="identity"):
        train_guard = Net()
        from nanreplay import NanGuard
        NanGuard(train_guard, identity={"host": 17})


def test_a_record_whose_rerun_failed_again_while_the_replay_is_finite_is_not_called_transient(tmp_path):
    """A crafted file (the record edited, not a guard's): the re-run failed again, yet the replay here is finite —
    the diagnosis must not call that a transient fault."""
    path, _ = train(tmp_path / "snaps", flip_at=3)
    d = torch.load(path, weights_only=True)
    d["rerun"]["rerun"].update(loss=float("nan"), loss_finite=False)
    torch.save(d, tmp_path / "crafted.pt")
    a = analyze(tmp_path / "crafted.pt")
    assert _machine(a)["verdict"] == "reproducible"
    assert a.diagnosis["cause"] == "not_reproduced" and "not transient" in a.diagnosis["explanation"]
