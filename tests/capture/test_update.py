"""The update check: NanGuard snapshots the optimizer step that made the weights NaN/Inf, at that step.

What the snapshot holds (validated data: the optimizer's class name, hyperparameters, implementation path,
state and gradients, the weights before the step — copied or recovered), that the recovery of the weights and
state before a step is right to a rounding step for every invertible optimizer setting, and that the hooks
cost nothing when off and are gone when the guard is.
"""

from __future__ import annotations

import gc

import optimizer_loops as L
import pytest
import torch
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.capture import update as upd
from nanreplay.errors import SnapshotError
from nanreplay.formats import load, native
from nanreplay.replay.update import UpdateSubject, run_update


def _snap(path) -> dict:
    return torch.load(path, weights_only=True)


def test_half_adam_is_caught_at_the_update_that_broke_the_weights(tmp_path):
    run = L.half_adam(tmp_path)
    assert (run.trigger, run.step) == ("update", 0)
    d = _snap(run.guard.last_snapshot)
    assert d["trigger"] == "update" and d["step"] == 0 and "_update_" in run.guard.last_snapshot
    u = d["update"]
    assert u["class"] == "Adam" and u["implementation"] == "single_tensor" and u["pre_step"] == "reconstructed"
    assert u["groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert u["groups"][0]["hyper"]["eps"] == 1e-8 and u["groups"][0]["hyper"]["betas"] == [0.9, 0.999]
    assert u["state"] == {}  # step 1: Adam creates its state inside this step
    assert set(u["gradients"]) == set(d["parameters"]) and all(torch.isfinite(g).all() for g in u["gradients"].values())
    # every entry the update overwrote with Inf is marked, and the snapshot's weights are finite (stand-ins)
    assert u["nonfinite_after"] and {n: int(m.sum()) for n, m in u["lost"].items()} == \
        {n: c["nan"] + c["posinf"] + c["neginf"] for n, c in u["nonfinite_after"].items()}
    assert all(torch.isfinite(d["state"][n]).all() for n in d["parameters"])
    assert d["step_program"] is not None and d["optimizer"]["state_dict"] is None
    assert native.parse("x.pt", d).raw["update"]["class"] == "Adam"


def test_the_late_snapshot_is_not_written_twice(tmp_path):
    """The loop ignores update_ok() and runs on: the next loss is NaN, and loss_ok says so without a second file."""
    run = L.half_adam(tmp_path, stop=False, steps=3)
    assert (run.trigger, run.step) == ("update", 0)
    assert len(run.guard.snapshots) == 1 and run.guard.last_snapshot == run.guard.snapshots[0]
    assert list(tmp_path.glob("*.pt")) == [tmp_path / run.guard.snapshots[0].rsplit("/", 1)[-1]]


def test_raise_mode_raises_from_the_step(tmp_path):
    from nanreplay.errors import NonFiniteStep

    with pytest.raises(NonFiniteStep):
        L.half_adam(tmp_path, on_nonfinite="raise")
    assert len(list(tmp_path.glob("*_update_*.pt"))) == 1


def test_foreach_path_is_recorded(tmp_path):
    run = L.half_adam(tmp_path, foreach=True)
    assert run.trigger == "update" and _snap(run.guard.last_snapshot)["update"]["implementation"] == "foreach"


def test_keep_pre_step_holds_the_exact_weights_and_state(tmp_path):
    """keep_pre_step=True: the snapshot's weights and state are bit-for-bit those before the failing step."""
    model = L.mlp(torch.float16)
    opt = torch.optim.Adam(model.parameters(), eps=1e-4)
    seen = {}

    def at_step(step, opt):
        if step == 2:  # from here on eps rounds to 0 in float16
            for group in opt.param_groups:
                group["eps"] = 1e-8
        seen["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        seen["state"] = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()
                         if p in opt.state}
    run = L.train(model, opt, tmp_path, dtype=torch.float16, before_step=at_step, keep_pre_step=True, steps=20)
    assert run.trigger == "update" and run.step >= 2
    d = _snap(run.guard.last_snapshot)
    u = d["update"]
    assert u["pre_step"] == "copied" and not u["lost"]
    for n, w in seen["weights"].items():
        assert torch.equal(d["state"][n], w), n
        for k, v in seen["state"][n].items():
            assert torch.equal(u["state"][n][k], v), (n, k)


def test_a_nonfinite_lr_is_copied_exactly_without_keep_pre_step(tmp_path):
    run = L.inf_schedule(tmp_path)
    assert (run.trigger, run.step) == ("update", 3)
    u = _snap(run.guard.last_snapshot)["update"]
    assert u["pre_step"] == "copied" and u["groups"][0]["hyper"]["lr"] == float("inf")
    assert u["scheduler"]["class"] == "LambdaLR" and u["scheduler"]["last_lr"] == [float("inf")]
    assert u["scheduler"]["last_epoch"] == 3


CONFIGS = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.5, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "maximize": True}),
    ("Adam", {"lr": 1e-2}),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}),
    ("AdamW", {"lr": 1e-2, "amsgrad": True, "maximize": True}),
]


@pytest.mark.parametrize("cls,kw", CONFIGS, ids=[f"{c}-{'-'.join(k)}" for c, k in CONFIGS])
@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_recovery_matches_an_exact_copy(cls, kw, first):
    """The weights and state before a step, recovered from what it left, equal an exact copy to a rounding step;
    replaying the step from them gives the weights it gave."""
    model = L.mlp()
    opt = getattr(torch.optim, cls)(model.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(1 if first else 4):
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre = upd.PreStep()
        pre.take(opt)
        opt.step()
    exact, exact_w = upd.update_record(opt, model, pre)
    got, got_w = upd.update_record(opt, model, None)
    assert exact["pre_step"] == "copied" and got["pre_step"] == "reconstructed" and not got["lost"]
    for n in exact_w:
        torch.testing.assert_close(got_w[n], exact_w[n], rtol=1e-5, atol=1e-6)
        for k, v in exact["state"].get(n, {}).items():
            torch.testing.assert_close(got["state"][n][k], v, rtol=1e-4, atol=1e-6)
    # (a first SGD step with momentum has no buffer before it; the recovered one gives the same buffer after it)
    now = {n: p.detach() for n, p in model.named_parameters()}
    for rec, weights in ((exact, exact_w), (got, got_w)):
        replayed = run_update(UpdateSubject(rec["class"], rec["implementation"], rec["groups"], weights,
                                            rec["gradients"], rec["state"]))
        assert replayed.finite
        for n, w in now.items():
            torch.testing.assert_close(replayed.after[n], w, rtol=1e-5, atol=1e-6)


def test_an_optimizer_it_cannot_invert_keeps_the_post_step_weights(tmp_path):
    model = L.mlp(torch.float16)
    run = L.train(model, torch.optim.RMSprop(model.parameters(), lr=1e-2), tmp_path, dtype=torch.float16)
    assert run.trigger == "update"
    u = _snap(run.guard.last_snapshot)["update"]
    assert u["pre_step"] == "post_step" and u["class"] == "RMSprop" and not u["lost"]
    assert "square_avg" in next(iter(u["state"].values()))


def test_healthy_training_writes_nothing_and_logs_the_lr(tmp_path):
    model = L.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run = L.train(model, opt, tmp_path, steps=5)
    assert run.trigger is None and not list(tmp_path.iterdir())
    assert [row["lr"] for row in run.guard.history] == [3e-3] * 5


def _hooks(opt) -> int:
    return len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)


def test_hooks_go_with_close_and_with_the_guard(tmp_path):
    model = L.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=tmp_path)
    assert _hooks(opt) == 2
    guard.close()
    assert _hooks(opt) == 0
    guard.close()  # twice is fine
    with NanGuard(model, opt, loss_fn=F.cross_entropy, folder=tmp_path):
        assert _hooks(opt) == 2
    assert _hooks(opt) == 0
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=tmp_path)
    del guard
    gc.collect()
    assert _hooks(opt) == 0  # the hooks hold the guard weakly: it is collected, and they go with it
    NanGuard(model, opt, loss_fn=F.cross_entropy, folder=tmp_path, check_update=False)
    assert _hooks(opt) == 0


def test_weights_and_state_after_the_snapshot_are_untouched(tmp_path):
    """Writing the snapshot puts the weights before the step into the model for a moment: they come back."""
    model = L.mlp(torch.float16)
    opt = torch.optim.Adam(model.parameters())
    after = {}

    def grab(opt, args, kwargs):
        after.update({n: p.detach().clone() for n, p in model.named_parameters()})
    opt.register_step_post_hook(grab)  # registered first: runs before the guard's
    run = L.train(model, opt, tmp_path, dtype=torch.float16)
    assert run.trigger == "update"
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), after[n], rtol=0, atol=0, equal_nan=True)


def test_a_damaged_update_record_is_refused(tmp_path):
    run = L.half_adam(tmp_path)
    d = _snap(run.guard.last_snapshot)
    d["update"]["gradients"]["0.weight"] = torch.zeros(3)
    bad = tmp_path / "bad.pt"
    torch.save(d, bad)
    with pytest.raises(SnapshotError, match="gradients"):
        load(str(bad))
    d = _snap(run.guard.last_snapshot)
    d["update"]["groups"][0]["params"].append("not.a.parameter")
    torch.save(d, bad)
    with pytest.raises(SnapshotError, match="not.a.parameter"):
        load(str(bad))
