"""A fix must be a no-op where the original was fine: a rewrite that changes the values the step computed
fine is not verified, however finite and plausible its loss.

A graph-attention softmax over each node's incoming edges, per head: the normaliser is a segment sum
(index_add over the edges' targets), the softmax runs over dim 0. One edge's score overflows exp. The
max-subtraction fix assumes the softmax is over dim -1 (its reasoning says so): it subtracts each edge's
maximum over the heads, which changes the attention weights of every healthy segment. Its replay is finite;
the no-op check, made where the rewritten expression ends (the division), rejects it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cases import Case
from nanreplay import analysis, formats, verify

DST = [0, 0, 1, 1, 1, 2, 2, 3]  # the target node of each of 8 edges


class GraphAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(4, 2)  # two heads
        with torch.no_grad():
            self.score.weight.abs_()  # positive weights: a large positive input is a large score in both heads

    def forward(self, x, v):
        dst = torch.tensor(DST)
        e = torch.exp(self.score(x))  # the line whose exp overflows
        denom = torch.zeros(4, 2).index_add(0, dst, e)
        alpha = e / denom[dst]
        return (alpha * v).sum()


def graph_attention():
    torch.manual_seed(0)
    return GraphAttention()


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    x[6] = 300.0  # an edge into node 2 whose scores are far above exp's range
    return {"x": (x, torch.randn(8, 2, generator=g))}


def test_a_rewrite_that_changes_healthy_values_is_not_verified(tmp_path):
    c = Case("graph_attention", __name__, "graph_attention", _batch)
    path = c.save(tmp_path / "gat.pt")
    res = analysis.analyze(path, model=c.model_spec)
    d = res.to_json()
    assert d["verdict"] == "culprit_found" and d["culprit"]["op"] == "aten.exp.default", d["culprit"]
    # the segment softmax's own fix (the maximum per segment, along the index_add's dim) is exact: a no-op
    fix = d["diagnosis"]["fix"]
    assert d["diagnosis"]["cause"] == "segment_softmax" and fix["verified"] is True, fix["verification"]
    assert "unchanged" in fix["verification"]
    # the maximum over dim -1 (each edge's maximum over the heads) changes every healthy segment's weights: finite,
    # and rejected by the no-op check made where the rewritten expression ends (the division)
    subject = formats.rebuild(formats.load(path), model=c.model_spec, loss=None, device=None, trust=False)
    step = res.step
    call = step.call_of(step.events[res.culprit["event"]])
    div = next(r.call for r in step.ops if str(r.op).startswith("aten.div") and r.call)

    def dim_last(func, args, kwargs):
        t = args[0]
        return func(t - t.detach().amax(dim=-1, keepdim=True), *args[1:], **kwargs)
    o = verify.try_patch(subject, {call: dim_last}, compare_at=[div])
    assert o.ok and o.noop is not None and not o.noop.ok, o.detail
    assert "changes values the original computed fine" in o.noop.sentence()


class RMSScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        h = h * (x.abs().sum(-1, keepdim=True) > 0)  # a sample that is all padding is all zeros
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))  # the line whose rsqrt meets 0


def test_the_no_op_check_judges_in_the_precision_the_step_computes_in(tmp_path):
    # under bf16 autocast the ε the epsilon policy sizes to one bf16 rounding step moves the float32 rsqrt by
    # ~0.5%: within the step's own rounding (2^-7), so a no-op; 100 × that ε, which moves healthy rows far more, is not
    from nanreplay import NanGuard

    torch.manual_seed(0)
    model = RMSScale()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, folder=tmp_path, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(4, 6, 8) * 3, torch.zeros(4, 6, 8)
    x[1] = 0.0
    guard.begin(x, y, step=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x), y)
    assert not guard.loss_ok(loss)
    d = analysis.analyze(guard.last_snapshot).to_json()
    assert d["culprit"]["op"].startswith("aten.rsqrt"), d["culprit"]
    fixes = [d["diagnosis"]["fix"], *d["diagnosis"]["candidates"]]
    eps = {f["epsilon"]: f for f in fixes if f.get("epsilon") is not None}
    best = eps[min(eps)]
    assert "not a no-op" not in best["verification"], best["verification"]
    assert f"unchanged within {2 ** -7:g} of their scale" in best["verification"], best["verification"]
    # ε × 100 changes healthy rows: its loss is no reference for an ε that does not (the ε-sensitivity test
    # counts only where the no-op check could not be made), and the check says why
    assert best["verified"] is True, best["verification"]
    assert f"the loss at ε = {best['epsilon'] * 100:.0e}" in best["verification"], best["verification"]
    assert "is no reference: that ε changes values the original computed fine" in best["verification"]


class _Exact:
    """A float64 reference of the step at one call (what verify.Float64Reference gives), here the exact value."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def at(self, call):
        return [self.value]


def test_a_fix_that_moves_values_towards_the_float64_value_is_a_no_op():
    # log(softmax(x)) → log_softmax(x): where softmax underflowed to a subnormal, log(p) is far from the exact value
    # (a subnormal p has few bits), and the exact form moves it by much more than rounding — towards that value
    from nanreplay.verify import NoOp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 200, generator=g) * torch.tensor([[1.0], [20.0], [40.0], [60.0]])
    p = torch.softmax(x, -1)
    exact = torch.log_softmax(x.double(), -1)
    original = torch.log(p)
    sub = torch.isfinite(original) & (p < torch.finfo(torch.float32).tiny)
    assert sub.sum() > 3, int(sub.sum())  # the case needs values that underflowed to subnormals

    by_rounding = NoOp()  # without a reference: the raw move alone, as before
    by_rounding.compare("log", torch.log_softmax(x, -1), original)
    assert not by_rounding.ok and by_rounding.changed > 0

    check = NoOp(reference=_Exact(exact))
    check.compare("log", torch.log_softmax(x, -1), original, call=7, func=torch.log, args=(p,))
    assert check.ok, check.sentence()
    assert check.closer == by_rounding.changed and check.referenced > 0
    assert "no farther from a float64 replay of the step" in check.sentence()

    # an ε that moves those values away from the exact value, beyond the original's own error there, is rejected
    away = NoOp(reference=_Exact(exact))
    away.compare("log", torch.log(p + 1e-30), original, call=7, func=torch.log, args=(p,))
    assert not away.ok and away.changed >= int(sub.sum()) // 2, away.sentence()
    assert "farther from a float64 replay of the step than the original's own error" in away.sentence()


def test_a_clamp_within_the_inputs_last_bit_is_a_no_op_and_a_wider_one_is_not():
    # acos of cosines near 1 (small angles): clamping 1.0 to the float32 just below it moves acos by 3.5e-4 — a
    # large share of these small angles, but no more than acos moves when its input moves by its last bit
    from nanreplay.verify import NoOp
    cos = torch.tensor([1.0, 1.0 - 2 ** -24, 0.99995, 0.9999, 0.99993], dtype=torch.float32)
    original = torch.acos(cos)

    tight = NoOp()
    tight.compare("acos", torch.acos(cos.clamp(-1 + 6e-8, 1 - 6e-8)), original, call=3, func=torch.acos,
                  args=(cos,))
    assert tight.ok and tight.closer == 1, tight.sentence()

    wide = NoOp()
    wide.compare("acos", torch.acos(cos.clamp(-1 + 1e-4, 1 - 1e-4)), original, call=3, func=torch.acos, args=(cos,))
    assert not wide.ok, wide.sentence()
