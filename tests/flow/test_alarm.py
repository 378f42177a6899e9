"""The dead-gradient triggers' policy (#39, docs/flow.md): a zero gradient the loss does not depend on (a cancelling
subtraction or normalisation, a softmax over one element, a weight multiplying a zero state, a batch whose
advantages are all zero) is a warning, not a snapshot; a zero that the parameter's values make (saturated, dead
units) still writes one; a module whose share of the gradient norm collapses writes `gradient_vanished`."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.analysis import analyze


class Siamese(nn.Module):
    """enc(a) - enc(b): the encoder's last bias enters both sides and cancels exactly."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, a, b):
        return self.head(self.enc(a) - self.enc(b))


class SoftmaxOverOne(nn.Module):
    """Additive attention whose softmax runs over a dimension of size 1 (transformers' SwiftFormer): w_g is inert."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(8, 8), nn.Linear(8, 1)
        self.w_g = nn.Parameter(torch.randn(8, 1))

    def forward(self, x):
        q = self.q(x).unsqueeze(1)
        return self.out((torch.softmax(q @ self.w_g, dim=-1) * q).squeeze(1))


class SaturatedOut(nn.Module):
    """A sigmoid output saturated from the start (sigmoid(40) is exactly 1.0 in float32): every gradient is zero,
    and the parameters' values are why."""

    def __init__(self):
        super().__init__()
        self.body, self.out = nn.Linear(8, 8), nn.Linear(8, 1)
        with torch.no_grad():
            self.out.bias.fill_(40.0)
            self.out.weight.mul_(0.01)

    def forward(self, x):
        return torch.sigmoid(self.out(torch.tanh(self.body(x))))


def _train(tmp_path, model, steps=4, batch=None, check_flow=True, sgd=None):
    opt = torch.optim.SGD(model.parameters(), lr=sgd) if sgd else torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, check_flow=check_flow)
    for step in range(steps):
        x, y = batch() if batch else (torch.randn(16, 8), torch.randn(16, 1))
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(*x) if isinstance(x, tuple) else model(x), y)
        assert guard.loss_ok(loss)
        loss.backward()
        assert guard.grads_ok()
        opt.step()
    return guard


def _pairs():
    return (torch.randn(16, 8), torch.randn(16, 8)), torch.randn(16, 1)


@pytest.mark.parametrize("kind", ["siamese", "softmax_one", "rnn_cell"])
def test_a_zero_gradient_the_loss_does_not_depend_on_is_a_warning_once_not_a_snapshot(tmp_path, caplog, kind):
    torch.manual_seed(0)
    model, batch, name = {
        "siamese": (Siamese, _pairs, "enc.2.bias"),
        "softmax_one": (SoftmaxOverOne, None, "w_g"),
        # an RNN cell run once from a zero state: weight_hh multiplies zeros
        "rnn_cell": (lambda: nn.Sequential(nn.Linear(8, 8), nn.RNNCell(8, 8), nn.Linear(8, 1)), None, "1.weight_hh"),
    }[kind]
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        guard = _train(tmp_path, model(), steps=6, batch=batch)
    assert guard.flow_snapshots == [] and not list(tmp_path.glob("*.pt"))
    assert list(guard.flow_watch.inert) == [name]
    said = [r.getMessage() for r in caplog.records if "does not depend on the value of" in r.getMessage()]
    assert len(said) == 1 and name in said[0] and "check_flow={'inert': True}" in said[0]


def test_inert_true_writes_the_snapshot_and_its_analysis_is_the_usual_one(tmp_path):
    torch.manual_seed(0)
    guard = _train(tmp_path, Siamese(), batch=_pairs, check_flow={"inert": True})
    assert len(guard.flow_snapshots) == 1 and "no_gradient" in guard.flow_snapshots[0]
    dead = torch.load(guard.flow_snapshots[0], weights_only=True)["gradient_flow"]["dead"]
    assert [d["name"] for d in dead] == ["enc.2.bias"] and dead[0]["gradient"] == "zero"


def test_a_zero_its_values_make_still_fires_from_the_first_step(tmp_path):
    """Saturated from initialisation: moving the values revives the gradient, so this is a failure, not inert."""
    torch.manual_seed(0)
    guard = _train(tmp_path, SaturatedOut())
    assert len(guard.flow_snapshots) == 1 and "no_gradient" in guard.flow_snapshots[0]
    gf = torch.load(guard.flow_snapshots[0], weights_only=True)["gradient_flow"]
    assert {d["name"] for d in gf["dead"]} == {"body.weight", "body.bias", "out.weight", "out.bias"}
    assert gf["all_zero"] is True and guard.flow_watch.inert == {}


# ------------------------------------------------------------------ zero advantage (GRPO)


def grpo_step(policy, batch):
    """GRPO's policy-gradient term: each group's advantages are its rewards minus their mean over the std."""
    obs, actions, rewards = batch
    logp = F.log_softmax(policy(obs), -1).gather(-1, actions[:, None]).squeeze(-1)
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    return -(adv.detach() * logp).mean()


def _grpo(tmp_path, equal: list[bool], check_flow=True):
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(policy.parameters(), lr=1e-2)
    guard = NanGuard(policy, opt, step_fn=grpo_step, folder=tmp_path, check_flow=check_flow)
    for step, same in enumerate(equal):
        rewards = torch.full((8,), 1.0) if same else torch.randint(0, 2, (8,)).float()
        batch = (torch.randn(8, 6), torch.randint(0, 4, (8,)), rewards)
        guard.begin(batch, step=step)
        opt.zero_grad()
        loss = grpo_step(policy, batch)
        assert guard.loss_ok(loss)
        loss.backward()
        assert guard.grads_ok()
        opt.step()
    return guard


def test_groups_whose_rewards_are_all_equal_are_counted_and_named_once_never_a_snapshot(tmp_path, caplog):
    equal = [False, True, True, True, True, False, True, False, True, True, True, True, True]
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        guard = _grpo(tmp_path, equal)
    assert guard.flow_snapshots == [] and guard.flow_watch.all_zero_count == sum(equal)
    assert guard.flow_watch.inert == {}  # the batch's property, not the parameters'
    said = [r.getMessage() for r in caplog.records if "every gradient was exactly zero" in r.getMessage()]
    assert len(said) == 1 and "zero advantage" in said[0] and "all_zero_steps" in said[0]


def test_all_zero_steps_makes_a_run_of_them_write_a_snapshot(tmp_path):
    guard = _grpo(tmp_path, [False, True, False, True, True, True], check_flow={"all_zero_steps": 3})
    assert len(guard.flow_snapshots) == 1 and "step000005" in guard.flow_snapshots[0]
    assert torch.load(guard.flow_snapshots[0], weights_only=True)["gradient_flow"]["all_zero"] is True


# ------------------------------------------------------------------ vanishing


def _deep_sigmoid(tmp_path, jump: int | None, steps: int = 64, check_flow=True):
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Linear(16, 16), nn.Sigmoid())]
    model = nn.Sequential(*layers, nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, check_flow=check_flow)
    for step in range(steps):
        x, y = torch.randn(32, 16), torch.randn(32, 1)
        for g in opt.param_groups:
            g["lr"] = 1000.0 if step == jump else 0.1  # one step at lr 1000 saturates the sigmoids
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        guard.loss_ok(loss)
        loss.backward()
        guard.grads_ok()
        opt.step()
    return guard


def test_a_deep_sigmoid_mlp_saturated_by_an_lr_jump_fires_gradient_vanished_for_the_layers_behind(tmp_path):
    guard = _deep_sigmoid(tmp_path, jump=33)
    (path,) = guard.flow_snapshots
    assert "gradient_vanished" in path
    gf = torch.load(path, weights_only=True)["gradient_flow"]
    names = [v["module"] for v in gf["vanished"]]
    assert "0" in names and "12" not in names  # the first layer vanished; the output layer carries the norm
    assert all(v["share"] < v["median_share"] / 1e4 for v in gf["vanished"])
    d = analyze(path).to_json()
    assert d["verdict"] == "gradient_vanished" and d["gradient_flow"]["reproduced"] is True
    assert {"0.weight", "0.bias"} <= set(d["gradient_flow"]["parameters"])
    diag = d["diagnosis"]  # the jump is the cause (flow_divergence): the rate's fix, the collapse its mechanism
    assert "jumped from 0.1 (steps 0–32) to 1000 at step 33" in diag["explanation"]
    assert diag["cause"] == "training_diverged" and diag["mechanism"]["cause"] == "gradient_vanished"
    assert diag["fix"]["settings"] == {"lr_bound": 0.1} and "group['lr'] = 0.1" in diag["fix"]["code"]


def test_the_same_mlp_without_the_jump_and_with_vanish_off_write_nothing(tmp_path):
    assert _deep_sigmoid(tmp_path / "healthy", jump=None).flow_snapshots == []
    assert _deep_sigmoid(tmp_path / "off", jump=33, check_flow={"vanish": None}).flow_snapshots == []


def test_a_loss_fitted_to_zero_shrinks_every_module_together_and_is_not_vanishing(tmp_path):
    """Memorising one batch: every gradient falls by many orders of magnitude, the shares stay put."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    guard = _train(tmp_path, nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)), steps=60,
                   batch=lambda: (x, y), sgd=0.3)
    assert guard.history[-1]["grad_norm"] < guard.history[5]["grad_norm"] / 1e3
    assert guard.flow_snapshots == []


def test_the_vanishing_watch_adds_no_tensor_op_to_a_step_and_the_check_reads_back_once(tmp_path):
    """The cost target (<= 1% of a 2 ms step, docs/flow.md): the zero count and the vanishing watch run on the host
    over the norms the check reads back with the total, so a sampled step dispatches the same tensor ops as any
    other and the check makes one host read."""
    from torch.overrides import TorchFunctionMode

    from nanreplay.capture import vanish
    from nanreplay.capture.flow import FlowWatch

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
    fw, per_step = FlowWatch(), []
    for step in range(4 * vanish.EVERY):
        calls: list[str] = []
        with Count():
            fw.measure(model, opt, step, True)
        per_step.append(calls)
    assert fw.vanish._rows >= vanish.WARM and fw.vanish._limit is not None  # the watch sampled and compared
    assert all(c == per_step[0] for c in per_step)  # sampled steps (every EVERY-th) add nothing
    assert per_step[0].count("tolist") == 1


class SiameseDropBN(Siamese):
    """The siamese model with dropout (the RNG) and a BatchNorm (buffers) on the way: the inert re-run must touch
    neither."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 4))


def test_the_inert_re_run_leaves_the_training_bitwise_unchanged(tmp_path):
    runs = []
    for check_flow in (True, False):
        torch.manual_seed(0)
        model = SiameseDropBN()
        guard = _train(tmp_path / str(check_flow), model, steps=5, batch=_pairs, check_flow=check_flow)
        runs.append(({k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state(), guard))
    (on, rng_on, guard), (off, rng_off, _) = runs
    assert list(guard.flow_watch.inert) == ["enc.4.bias"]  # the re-run happened on this run
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on) and torch.equal(rng_on, rng_off)
