"""A dtype taken from a tensor autocast made follows the replay's dtype policy, for every op that takes one.

Under fp16 autocast, `torch.zeros(..., dtype=h.dtype)` (transformers' T5 makes its position bias so) is a
float16 literal in the op the program records. A replay in bf16, fp32 or fp64 maps autocast's own casts to
its dtype; a literal kept float16 would meet tensors of the new dtype (`mm` refuses: "expected both
operands to have the same dtype"). Each creation form below feeds an `mm` with `h`, so a literal left behind
raises; the replay must run and agree with the eager step in fp32. A dtype the call names itself
(`.half()`) stays what it says.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay.capture.program import record_step
from nanreplay.formats.program import decode, to_json
from nanreplay.formats.stepmodel import StepModule

FORMS = {
    "zeros": lambda h, w: torch.zeros(8, 8, dtype=h.dtype) + torch.eye(8, dtype=h.dtype),
    "full": lambda h, w: torch.full((8, 8), 0.5, dtype=h.dtype),
    "empty": lambda h, w: torch.empty(8, 8, dtype=h.dtype),  # replayed as zeros
    "arange": lambda h, w: torch.arange(64, dtype=h.dtype).reshape(8, 8) / 64,
    "to": lambda h, w: w.to(h.dtype),
    "to_tensor": lambda h, w: w.to(h),
    "type_as": lambda h, w: w.type_as(h),
    "tensor": lambda h, w: torch.tensor([[0.125 * (i - j) for j in range(8)] for i in range(8)], dtype=h.dtype),
    "ones_like": lambda h, w: torch.ones_like(w, dtype=h.dtype),
}


class Net(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.fc, self.w, self.form = nn.Linear(8, 8), nn.Parameter(torch.randn(8, 8) / 8), FORMS[form]

    def forward(self, x):
        h = self.fc(x)  # float16 under autocast
        return torch.mm(h, self.form(h, self.w))


# (label, replay dtype of weights and batch, the policy: all dtypes, autocast's dtype)
REPLAYS = [("float32", torch.float32, {torch.float32: torch.float32}, {torch.float16: torch.float32}),
           ("autocast bfloat16", None, {}, {torch.float16: torch.bfloat16}),
           ("float64", torch.float64, {torch.float32: torch.float64}, {torch.float16: torch.float64})]


def _recorded(form):
    torch.manual_seed(0)
    m, x, y = Net(form), torch.randn(4, 8), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        rec = record_step(lambda: m(x), lambda out: F.mse_loss(out.float(), y), model=m,
                          batch={"inputs": x, "target": y})
    with torch.no_grad():
        ref = float(F.mse_loss(m(x), y))  # the eager step in fp32
    prog = decode(to_json(rec.program))
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return prog, rec, state, [n for n, _ in m.named_parameters()], x, y, ref


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_dtype_taken_from_an_autocast_tensor_follows_every_replay_dtype(form):
    prog, rec, state, params, x, y, eager = _recorded(form)
    losses = {}
    for label, dtype, all_map, cast_map in REPLAYS:
        model = StepModule(prog, {k: v.clone() for k, v in state.items()}, params, {}, rec.constants)
        model.set_policy(all_map, cast_map)
        xs, ys = x, y
        if dtype is not None:
            model.to(dtype)
            xs, ys = x.to(dtype), y.to(dtype)
        loss = model(xs, ys)  # a literal left float16 would make mm raise here
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), label
        losses[label] = float(loss.detach())
    if form != "empty":  # eager's empty() is uninitialised memory; a replay's is zeros
        assert losses["float32"] == pytest.approx(eager, rel=1e-4), losses
    assert losses["float64"] == pytest.approx(losses["float32"], rel=1e-4), losses
    assert losses["autocast bfloat16"] == pytest.approx(losses["float32"], rel=5e-2), losses  # 8 bits of mantissa


def test_a_dtype_the_call_names_itself_stays():
    torch.manual_seed(0)
    m, x = nn.Linear(8, 8), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        rec = record_step(lambda: m(x).float().half(), lambda out: out.float().sum(), model=m,
                          batch={"inputs": x, "target": None})
    halves = [n for n in rec.program["nodes"] if n["op"] == "aten._to_copy.default"
              and n.get("kwargs", {}).get("dtype") == {"dtype": "float16"}]
    assert halves, rec.program["nodes"]
    linear = [n for n in halves if n.get("cast")]  # autocast's casts of the linear's input and weights
    assert len(linear) == len(halves) - 1, halves  # `.half()` is the user's, not autocast's: it is not mapped
