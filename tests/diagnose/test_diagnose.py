"""Causes, fixes and fix verification by replay."""

from __future__ import annotations

import pytest
import torch

from nanreplay import diagnose
from nanreplay.diagnose import choose_eps, rule

EXPECTED = {  # case -> (cause, fix kind)
    "sqrt_zero": ("sqrt_at_zero", "epsilon"),
    "inf_trap": ("sqrt_at_zero", "epsilon"),
    "log_zero": ("log_of_zero", "positive_parametrisation"),
    "sqrt_neg": ("sqrt_of_negative", "clamp"),
    "log_neg": ("log_of_negative", "clamp"),
    "zero_norm": ("normalize_zero_norm", "epsilon"),
    "zero_log_zero": ("zero_times_log_zero", "clamp"),
    "log_softmax": ("log_softmax", "log_softmax"),
    "fp16": ("fp16_overflow", "bf16_or_grad_scaler"),
    "masked_row": ("softmax_all_masked", "finite_mask_value"),
    "where_trap": ("where_trap", "double_where"),
    "in_loss": ("log_of_zero", "positive_parametrisation"),
    "inf_to_nan": ("exp_overflow", "clamp"),
}
# a log of 0 (or of a negative) in the loss is a real infinity: an eps makes it finite, but the loss is then what
# eps says (it moves when eps changes by two decades), so the fix is shown, replayed, and not verified. Where a ReLU
# made the logged value (log_zero, in_loss: log(relu(fc(x)))), the fix is softplus where it is made: another model,
# which these snapshots (no history, every element broken) give nothing to judge by: replayed finite, not verified
EPS_SETS_THE_LOSS = {"log_neg"}
NOT_JUDGED = {"log_zero", "in_loss"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_cause_and_verified_fix(analyzed, name):
    d = analyzed(name)
    cause, kind = EXPECTED[name]
    diag = d["diagnosis"]
    assert diag["cause"] == cause
    assert diag["fix"]["kind"] == kind
    assert "every parameter gradient finite" in diag["fix"]["verification"]
    if name in EPS_SETS_THE_LOSS:
        assert diag["fix"]["verified"] is False and "moves when ε changes" in diag["fix"]["verification"]
    elif name in NOT_JUDGED:
        assert diag["fix"]["verified"] is False and "not judged" in diag["fix"]["verification"]
    else:
        assert diag["fix"]["verified"] is True, diag["fix"]["verification"]


def test_xlogy_is_tried_and_honestly_fails(analyzed):
    """xlogy(p, p) is 0 at p = 0 in forward but its gradient p/p is still NaN: the clamp wins."""
    d = analyzed("zero_log_zero")
    first = d["diagnosis"]["candidates"][0]
    assert first["kind"] == "xlogy" and first["verified"] is False
    assert "XlogyBackward0" in first["verification"]


def test_fix_is_shown_on_the_users_own_line(analyzed):
    fix = analyzed("sqrt_zero")["diagnosis"]["fix"]
    assert fix["before"].startswith("return ((a - b) ** 2).sum(-1).sqrt()")
    assert fix["after"].startswith(f"return (((a - b) ** 2).sum(-1) + {fix['epsilon']:.0e}".replace("e-0", "e-"))
    assert fix["after"].rstrip().split("#")[0].rstrip().endswith(").sqrt()")


def test_log_softmax_fix_rewrites_the_call(analyzed):
    fix = analyzed("log_softmax")["diagnosis"]["fix"]
    assert "torch.log_softmax(self.fc(x), dim=-1)" in fix["after"]


def test_anomaly_sentence_for_inf(analyzed):
    d = analyzed("inf_trap", verify=False)
    assert "would have stayed silent" in d["diagnosis"]["explanation"]


def test_precision_probe_tells_range_from_domain(analyzed):
    fp16 = analyzed("fp16", verify=False)
    assert {r["dtype"]: r["loss_finite"] for r in fp16["precision"]}["float32"] is True
    assert "precision/range problem" in fp16["diagnosis"]["explanation"]
    dom = analyzed("log_neg", verify=False)
    assert "a math domain error, not a precision problem" in dom["diagnosis"]["explanation"]


def test_precision_probe_stops_at_a_backward_culprit_but_never_at_a_masked_forward_nan(analyzed):
    """sqrt at 0: the culprit is SqrtBackward0, NaN in float64 too, so the probe stops there (grads not finite).
    A forward NaN masked before the loss (sqrt of a negative under where) must not stop the full pass and
    get the loss called non-finite: the loss is finite, the gradients are not. The forward-alone pass of a
    loss failure runs under no_grad, where autograd's detach of tanh's saved output is not made: the sqrt
    is found by its call number all the same."""
    from nanreplay import verify
    from nanreplay.analysis.contract import precision_sentence
    from nanreplay.replay.subject import Subject

    rows = {r["dtype"]: r for r in analyzed("sqrt_zero", verify=False)["precision"]}
    assert rows["float64"]["loss_finite"] is True and rows["float64"]["grads_finite"] is False
    assert rows["float64"]["probe"].startswith("backward stopped after the culprit op")
    assert "nonfinite_grads" in rows["float64"] and rows["float64"]["nonfinite_grads"] is None  # kept, not counted

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            h = self.fc(x).tanh()  # tanh saves its output: with grad on, autograd adds a detach before the sqrt
            return torch.where(h > 0, h.sqrt(), torch.zeros_like(h))

    torch.manual_seed(0)
    subject = Subject(Masked(), torch.randn(8, 3), None, lambda out: out.sum(), "sum", "test", torch.device("cpu"))
    plain = verify.plain_step(subject)
    assert plain["loss_finite"] is True and plain["grads_finite"] is False
    ops: list[str] = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        subject.loss(subject.forward())
    sqrt = verify.Culprit.of("forward", ops.index("aten.sqrt.default"), "aten.sqrt.default", ops)
    assert sqrt.nth == 0 and "aten.detach.default" in ops[:ops.index("aten.sqrt.default")]
    row = verify.plain_step(subject, stop_at=sqrt)  # a gradient failure: the full pass is never cut short
    assert (row["loss_finite"], row["grads_finite"]) == (True, False) and "probe" not in row
    row = verify.plain_step(subject, forward_first=True, stop_at=sqrt)  # as for a loss failure: it stops
    assert row["loss_finite"] is False and row["probe"].startswith("stopped after the culprit op")
    # the probe of this gradient failure: the forward alone (no graph) stops at the sqrt, NaN in float64 too;
    # the gradients are not finite, the loss was not reached (not called non-finite), backward never runs
    (row,) = verify.precision_probe(subject, "float32", failure="gradient", culprit=sqrt)
    assert (row["dtype"], row["loss"], row["loss_finite"], row["grads_finite"]) == ("float64", None, None, False)
    assert row["probe"].startswith("stopped after the culprit op") and "reached the gradients" in row["probe"]
    assert "non-finite in float64 too" in precision_sentence([row], "float32")

    class Clamped(Masked):  # the sqrt never sees a negative: finite here, so the probe runs the whole step
        def forward(self, x):
            h = self.fc(x).tanh()
            return torch.where(h > 0, h.clamp(min=0).sqrt(), torch.zeros_like(h))

    torch.manual_seed(0)
    fine = Subject(Clamped(), torch.randn(8, 3), None, lambda out: out.sum(), "sum", "test", torch.device("cpu"))
    (row,) = verify.precision_probe(fine, "float32", failure="gradient", culprit=sqrt)  # not stopped: a whole step
    assert "probe" not in row and (row["loss_finite"], row["grads_finite"]) == (True, True)


@pytest.mark.parametrize("dtype,scale", [("float32", 1.0), ("float16", 1.0), ("bfloat16", 1.0), ("float32", 1e4)])
def test_epsilon_fits_dtype_and_scale(dtype, scale):
    eps, why = choose_eps(dtype, scale, "f")
    fi = torch.finfo(getattr(torch, dtype))
    assert fi.eps * scale / 10 < eps <= fi.eps * scale
    # adding eps moves the largest value seen by at most one rounding step of the dtype
    big = torch.tensor(scale, dtype=getattr(torch, dtype))
    assert float((big + eps) - big) <= fi.eps * scale
    assert dtype in why


def test_registry_fails_loudly():
    with pytest.raises(ValueError, match="registered twice"):
        rule("sqrt_at_zero", torch.ops.aten.sqrt)(lambda s: None)
    with pytest.raises(TypeError, match="not an aten op"):
        rule("new_cause", "aten.sqrt")
    assert len({r.cause for r in diagnose.RULES}) == len(diagnose.RULES)


def test_no_verify_skips_the_fix_replays(analyzed):
    d = analyzed("masked_row", verify=False)
    assert d["diagnosis"]["fix"]["kind"] == "finite_mask_value"
    assert d["diagnosis"]["fix"]["verified"] is None and d["diagnosis"]["candidates"] == []


def test_a_bug_in_a_custom_backward_is_fixed_where_it_is(analyzed):
    """The division by zero is in the user's hand-written backward(): the fix is verified there."""
    import nanmodels

    d = analyzed("custom_backward")
    assert d["culprit"]["source"]["line"] == nanmodels.CASES.marker_line("custom_backward")
    fix = d["diagnosis"]["fix"]
    assert d["diagnosis"]["cause"] == "division_by_zero" and fix["verified"] is True
    assert fix["before"].startswith("return -g / (x * x)") and ".clamp_min(" in fix["after"]


def test_float64_probe_of_an_autocast_program_runs_every_op_in_float64(tmp_path):
    """A bf16-autocast step with a BatchNorm (which takes a bf16 input with float32 weights): in the float64
    probe, the casts autocast inserted must go to float64 too. They went to float32 while the weights were
    float64, and the row said `mixed dtype (CPU): expect parameter to have scalar type of Float`."""
    import torch.nn as nn
    import torch.nn.functional as F

    from nanreplay import NanGuard
    from nanreplay.analysis import analyze

    def masked_ce(logits, y):
        valid = (y != 255).float()
        ce = F.cross_entropy(logits.float(), y.clamp(max=2), reduction="none")
        return (ce * valid).sum() / valid.sum()  # an all-ignore batch: 0 / 0

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 3, 1))
    guard = NanGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=masked_ce, folder=tmp_path)
    x, y = torch.randn(2, 3, 8, 8), torch.full((2, 8, 8), 255)
    guard.begin(x, y, step=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = masked_ce(model(x), y)
    assert not guard.loss_ok(loss)
    rows = {r["dtype"]: r for r in analyze(guard.last_snapshot).to_json()["precision"]}
    assert set(rows) == {"float32 (autocast off)", "float64"}
    assert all("error" not in r and r["loss_finite"] is False for r in rows.values()), rows
