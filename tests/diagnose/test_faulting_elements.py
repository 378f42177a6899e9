"""The no-op check leaves out the elements where the original broke in its backward: an output that was finite
but whose derivative was not (sqrt(0), acosh(1)) is where the gradient became NaN/Inf, not a value the original
computed fine. A fix may move those; it may not move an element whose derivative was finite, however small it is."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard, analysis
from nanreplay.noop import NoOp

aten = torch.ops.aten


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.cls = nn.Linear(8, 3)

    def forward(self, x):
        h = self.enc(x)
        return self.cls(h), h


def diversity_loss(out, y):
    logits, h = out
    return F.cross_entropy(logits, y) - 0.1 * h.var(0).sqrt().mean()  # var 0 on a batch of duplicates


def test_sqrt_of_a_zero_variance_fix_is_verified_with_the_broken_elements_left_out(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = NanGuard(model, opt, folder=tmp_path, loss_fn=diversity_loss)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        if step == 2:
            x[:] = x[0]  # a batch of duplicates: every feature's variance is exactly 0
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = diversity_loss(model(x), y)
        assert guard.loss_ok(loss)
        loss.backward()
        if not guard.grads_ok():
            break
        opt.step()
    else:
        raise AssertionError("the duplicate batch's gradient was finite")
    d = analysis.analyze(guard.last_snapshot).to_json()
    fix = d["diagnosis"]["fix"]
    assert d["diagnosis"]["cause"] == "sqrt_at_zero" and fix["kind"] == "epsilon", d["diagnosis"]
    # every sqrt output was 0 with an infinite derivative: nothing the original computed fine moved
    assert fix["verified"] is True, fix["verification"]
    assert "derivative was not finite (where its gradient broke) left out" in fix["verification"]
    assert "the step's own finite loss" in fix["verification"], fix["verification"]


def _sqrt_noop(x: torch.Tensor, eps: float) -> NoOp:
    n = NoOp()
    n.compare("sqrt.default", aten.sqrt.default(x + eps), aten.sqrt.default(x), None, aten.sqrt.default, (x,), {})
    n.settle()
    return n


def test_only_elements_whose_derivative_broke_are_left_out():
    n = _sqrt_noop(torch.tensor([0.0, 1.0, 4.0]), 1e-3)
    assert n.ok and n.faulting == 1 and n.elements == 2, n.sentence()
    # an ε that moves a tiny but healthy value (its derivative 5e5 is finite) still changes the step
    n = _sqrt_noop(torch.tensor([1e-12, 1.0, 4.0]), 1e-3)
    assert not n.ok and n.faulting == 0 and n.changed == 1, n.sentence()
    # and an ε that moves the healthy values too is not a no-op, whatever it does where the original broke
    n = _sqrt_noop(torch.tensor([0.0, 1e-3, 4.0]), 1e-1)
    assert not n.ok and n.faulting == 1 and n.changed == 2, n.sentence()



# ------------------------------------------------------------------ an ε that sets a constant of the loss


class Policy(nn.Module):
    """Action probabilities as a mixture of two softmax heads (an ensemble policy): log of the mixture has no
    selection-of-log_softmax form, so the ε is the fix to judge."""
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))

    def forward(self, obs):
        a, b = self.net(obs).chunk(2, -1)
        return 0.5 * (a.softmax(-1) + b.softmax(-1))


def policy_loss(policy, target):
    actions, adv = target
    return -(torch.log(policy.gather(1, actions[:, None]).squeeze(1)) * adv).mean()


def _policy_snapshot(tmp_path, rows: int):
    """A softmax policy trained 3 steps, then a batch where `rows` observations are 1e5 too large and took the
    action the policy rules out: their probability is exactly 0 (underflow), log(0) = -inf."""
    torch.manual_seed(0)
    model = Policy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = NanGuard(model, opt, folder=tmp_path, loss_fn=policy_loss)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        obs, actions, adv = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g), \
            torch.randn(8, generator=g)
        if step == 3:
            obs[:rows] *= 1e5
            with torch.no_grad():
                actions[:rows] = model(obs[:rows]).argmin(-1)
        guard.begin(obs, (actions, adv), step=step)
        opt.zero_grad()
        loss = policy_loss(model(obs), (actions, adv))
        if not guard.loss_ok(loss):
            return analysis.analyze(guard.last_snapshot).to_json()
        loss.backward()
        assert guard.grads_ok()
        opt.step()
    raise AssertionError("the bad batch's loss was finite")


def test_log_of_an_exact_zero_probability_verifies_by_its_update(tmp_path):
    # one sample of 8: log(p + ε) is log(ε) there, and its gradient is 0 whatever ε (dp = 0 where p underflowed)
    d = _policy_snapshot(tmp_path, rows=1)
    fix = d["diagnosis"]["fix"]
    assert d["diagnosis"]["cause"] == "log_of_zero" and fix["kind"] == "epsilon", d["diagnosis"]
    assert fix["verified"] is True, fix["verification"]
    assert "but no parameter's gradient does" in fix["verification"]
    assert "plausible against the recent history" in fix["verification"], fix["verification"]


def test_an_eps_that_sets_the_loss_of_most_of_the_batch_is_not_verified(tmp_path):
    # five samples of 8: the same update argument holds, but the fix would silence most of the batch: not evidence
    d = _policy_snapshot(tmp_path, rows=5)
    eps = [f for f in d["diagnosis"]["candidates"] if f["kind"] == "epsilon"]
    assert eps and all(f["verified"] is False for f in eps), [f["verification"] for f in eps]
    assert "moves when ε changes by two decades" in eps[0]["verification"], eps[0]["verification"]
    assert "but no parameter's gradient does" not in eps[0]["verification"]
