"""The diagnosis catalogue on purpose-built models (`causes.py`): cause, fix, and the fix verified by replay.

Every case is written to a real snapshot file (the seed's dict, via torch.save) and analysed exactly as
`nanreplay analyze SNAPSHOT --model causes:FACTORY --loss ...` would. Code fixes are checked twice: by
nanreplay's own replay with the fix patched in at the call site, and by applying the suggested source
line to a copy of the model's file and analysing the same snapshot again.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import causes
import nanmodels
from nanreplay import analysis, formats, verify
from nanreplay.diagnose import RULES, choose_eps
from tolerance import unrounded

# std over one element warns, in the user's model as in torch: that is the case under test.
pytestmark = pytest.mark.filterwarnings(r"ignore:std\(\):UserWarning")

NOT_CODE = ("lower_lr_clip_grads", "none")  # fixes that are not a change at the culprit site: nothing to verify
# Fixes that replay finite and are honestly not verified: an ε that sets the loss (x / ε, log(ε), erfinv(1 - ε):
# the loss moves when ε changes by two decades), or an ε so large in float16 that it moves the values that were fine.
NOT_VERIFIED = {"reciprocal_zero": "moves when ε changes",
                "x_over_zero": "moves when ε changes", "unknown_erfinv": "moves when ε changes",
                "signed_zero_fp16": "not a no-op"}
CAUSE_CASES = sorted(n for n, c in causes.CASES.items() if "cause" in c.expect)
CULPRIT_KEYS = ("phase", "kind", "op", "forward_op", "backward_node", "module")


JUDGED_BY_FINITE_PARTS = {"stateful_log_zero"}  # softplus for a ReLU rate, plain dict: its only reference


@pytest.mark.parametrize("name", CAUSE_CASES)
def test_cause_fix_and_verification(run_case, name):
    exp = causes.CASES[name].expect
    res, _ = run_case(name)
    d = res.to_json()
    assert d["verdict"] == "culprit_found"
    c = d["culprit"]
    for key in CULPRIT_KEYS:
        if key in exp:
            assert c[key] == exp[key], (key, c[key])
    marker = exp.get("marker", name)
    try:
        line = causes.CASES.marker_line(marker)
    except KeyError:
        assert c["source"] is None  # the loss named by --loss runs inside nanreplay: no user line
    else:
        assert (c["source"]["file"].endswith("causes.py"), c["source"]["line"]) == (True, line)
    diag = d["diagnosis"]
    assert (diag["cause"], diag["fix"]["kind"]) == (exp["cause"], exp["fix"])
    if exp["fix"] in NOT_CODE:
        assert diag["fix"]["verified"] is None and diag["fix"]["replay"] is None
    elif name in NOT_VERIFIED:
        assert diag["fix"]["verified"] is False and "every parameter gradient finite" in diag["fix"]["verification"]
        assert NOT_VERIFIED[name] in diag["fix"]["verification"], diag["fix"]["verification"]
    elif name in JUDGED_BY_FINITE_PARTS and "plausibility not judged" in diag["fix"]["verification"]:
        # a changed model is judged against the step's finite parts alone (no history in a plain dict); one CI
        # run under heavy load got no such reference (not reproduced in five reruns): then it must say so
        assert diag["fix"]["verified"] is False and diag["fix"]["replay"]["plausible"] is None, diag["fix"]
    else:
        assert diag["fix"]["verified"] is True, diag["fix"]["verification"]
        assert "every parameter gradient finite" in diag["fix"]["verification"]
        assert diag["fix"]["replay"]["plausible"] is not False, diag["fix"]["replay"]
    assert diag["cause"] in {r.cause for r in RULES}
    json.dumps(d, allow_nan=False)  # strict JSON
    assert not unrounded(d), f"prose writes a raw float repr (format it with stats.num): {unrounded(d)}"


# Fixes shown without a rewrite of the user's line, and why.
NO_REWRITE = {
    "bce_saturated": "the fix spans two places: return logits from the model, use them in the loss",
    "ce_all_ignored": "the loss is `--loss cross_entropy`: there is no user line to rewrite",
    "exploded": "the weights are the problem, not a line",
    "unknown_i0": "no fix is suggested",
    "autocast_fp16": "the fix is the autocast dtype, a whole-step change",
    "fp16": "the fix is the model's dtype, a whole-step change",
    "exploded_norm": "the weights are the problem, not a line",
    "bf16_overflow": "the weights are the problem, not a line",
    "vae_pixels": "no bound is guessed for the exp: the fix is guidance",
}


def _rewritable(module, names):
    return [pytest.param(module, n, id=f"{module.__name__}.{n}") for n in names
            if module.CASES[n].expect.get("verdict", "culprit_found") == "culprit_found" and n not in NO_REWRITE]


@pytest.mark.parametrize("module,name", _rewritable(causes, CAUSE_CASES) + _rewritable(nanmodels, nanmodels.CASES))
def test_suggested_line_is_runnable_and_fixes_the_step(run_case, tmp_path, monkeypatch, module, name):
    """Apply the shown `after` to a copy of the user's file: the same snapshot then replays finite."""
    res, path = run_case(name, module=module)
    fix = res.diagnosis["fix"]
    # replayed finite (verified, or honestly not: see NOT_VERIFIED), and shown as the user's line
    assert "every parameter gradient finite" in (fix["verification"] or "") and fix["before"] and fix["after"], fix
    assert fix["code"] == fix["after"]
    ast.parse(fix["after"])  # valid Python on its own
    fixed = f"{module.__name__}_fixed_{name}"
    src = Path(module.__file__).read_text().splitlines()
    before, after = fix["before"].splitlines(), fix["after"].splitlines()
    at = next(i for i in range(len(src)) if all(src[i + k].strip() == b.strip() for k, b in enumerate(before)))
    indent = src[at][:len(src[at]) - len(src[at].lstrip())]
    src[at:at + len(before)] = [indent + a for a in after]
    (tmp_path / f"{fixed}.py").write_text("\n".join(src) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    c = module.CASES[name]
    loss = c.loss.replace(f"{module.__name__}:", f"{fixed}:") if c.loss else None
    d = analysis.analyze(path, model=f"{fixed}:{c.factory}", loss=loss, verify=False).to_json()
    sys.modules.pop(fixed, None)
    assert d["verdict"] == "not_reproduced", (fix["after"], d["culprit"])
    assert isinstance(d["loss"], float)


def _replayed_loss(fix: dict) -> float:
    """The verifying replay's loss, from the JSON (the verification sentence shows it with 4 digits)."""
    return fix["replay"]["loss"]


def test_bce_fix_is_the_logits_form(run_case):
    """Both logs of the hand-written BCE are replaced (log p -> logsigmoid(z), log(1-p) -> logsigmoid(-z)),
    through the squeeze the model applies after its sigmoid: the replayed loss is BCE-with-logits."""
    res, _ = run_case("bce_saturated")
    fix = res.diagnosis["fix"]
    model, b = causes.scorer(), causes._bce_batch()
    with torch.no_grad():
        expected = F.binary_cross_entropy_with_logits(model.fc(b["x"]).squeeze(-1), b["y"]).item()
    assert _replayed_loss(fix) == pytest.approx(expected, rel=1e-5)
    # the fix spans the model and the loss: two edits, the model's sigmoid removed (it returns the logits) and
    # the loss's logs made logsigmoid of them, replayed as written
    sigmoid_line = next(i for i, t in enumerate(Path(causes.__file__).read_text().splitlines(), 1)
                        if "torch.sigmoid(self.fc(x)).squeeze(-1)" in t)
    model_edit, loss_edit = fix["edits"]
    assert model_edit["line"] == sigmoid_line and model_edit["after"].endswith("self.fc(x).squeeze(-1)")
    assert "logsigmoid(p)" in loss_edit["after"] and "logsigmoid(-p)" in loss_edit["after"]
    assert fix["tested_as"] == "line" and "holds the logits" in fix["reasoning"]


def test_logsumexp_fix_keeps_the_value(run_case):
    res, _ = run_case("handwritten_logsumexp")
    fix = res.diagnosis["fix"]
    assert "torch.logsumexp(s, dim=1)" in fix["after"]
    model, x = causes.hand_logsumexp(), causes.CASES["handwritten_logsumexp"].batch()["x"]
    with torch.no_grad():
        s = model.fc(x)
        expected = (torch.logsumexp(s, dim=1) - s[:, 0]).mean().item()
    assert _replayed_loss(fix) == pytest.approx(expected, rel=1e-5)


def test_std_of_one_element_tries_correction_then_keeps_it_off_zero(run_case):
    """Dropping the correction alone makes std = 0, and (h - mean) / 0 is NaN again: the replay says so, and the
    next candidate (plus clamp_min) is the one reported. The correction is dropped only for a group of one
    (min(1, n - 1)): a healthy batch keeps its unbiased std, unchanged."""
    res, _ = run_case("std_single")
    first, second = res.diagnosis["candidates"]
    assert first["verified"] is False and "aten.div.Tensor" in first["verification"]
    assert second["verified"] is True and second["epsilon"] is not None
    assert res.diagnosis["fix"]["after"].startswith(
        f"return ((h - h.mean(0)) / h.std(0, correction=min(1, h.shape[0] - 1)).clamp_min({second['epsilon']:.0e}))"
        .replace("e-0", "e-"))
    h = torch.randn(5, 3)  # the fix's std is torch's own unbiased std wherever there is more than one sample
    assert torch.equal(h.std(0, correction=min(1, h.shape[0] - 1)), h.std(0))


def test_reciprocal_fix_changes_the_denominator(run_case):
    fix = run_case("reciprocal_zero")[0].diagnosis["fix"]
    assert fix["after"].startswith("return (1.0 / rate.clamp_min(")


def test_epsilon_fits_float16(run_case):
    """x / s in float16 with a signed s: the eps that only looks at the values (1e-4) would overflow the
    gradient x / eps² that `s + eps` passes on to s. The chosen eps is raised to that floor and says why; it
    replays finite, but an eps of 1e-2 in float16 moves the quotients that were fine by percents: not a no-op,
    so not verified, and every larger candidate is tried and fails the same way. Replaying with 1e-4 confirms
    that it fails outright."""
    res, path = run_case("signed_zero_fp16")
    first, *rest = res.diagnosis["candidates"]
    fix = res.diagnosis["fix"]
    assert first["epsilon"] == 1e-2 and first["verified"] is False and first["replay"]["plausible"] is False
    assert "float16" in first["reasoning"] and "x / eps²" in first["reasoning"] and "1e-4" in first["reasoning"]
    assert "not a no-op" in first["verification"] and "changes values the original computed fine" in \
        first["verification"]
    assert rest and all(c["verified"] is False for c in rest) and fix["verified"] is False
    c = causes.CASES["signed_zero_fp16"]
    subject = formats.rebuild(formats.load(path), model=c.model_spec, loss=None, device=None, trust=False)
    call = res.step.call_of(res.step.events[res.culprit["event"]])
    small = verify.try_patch(subject, {call: lambda f, a, k: f(a[0], a[1] + 1e-4, **k)})
    assert small.ok is False and "gradient of s" in small.detail


def test_choose_eps_floor_and_reasoning():
    eps, why = choose_eps("float16", 1.0, "the quotient", floor=(1 / 65504) ** 0.5, floor_why="x / eps²")
    assert eps == 1e-2 and "needs eps ≥" in why and "float16" in why
    assert choose_eps("float32", 1.0, "f", floor=1e-30)[0] == 1e-7  # a floor below the usual eps changes nothing


def test_sqrt_cancellation_scale_comes_from_the_cancelled_terms(run_case):
    """The variance entry that went negative is rounding noise of E[x²] = 1.69: the explanation says so."""
    d = run_case("sqrt_cancellation")[0].to_json()
    assert "E[x²] − E[x]²" in d["diagnosis"]["explanation"] and "torch.var" in d["diagnosis"]["explanation"]
    assert d["diagnosis"]["fix"]["after"].startswith("var = torch.var(x, 0, correction=0)")
    assert "precision/range problem" in d["diagnosis"]["explanation"]  # float64 does not cancel below 0 here


def test_acos_backward_explains_the_exact_boundary(run_case):
    expl = run_case("asin_at_one")[0].diagnosis["explanation"]
    assert "exactly ±1" in expl and "AsinBackward0" in expl and "saturated tanh" in expl


def test_exploded_weights_names_them_and_is_not_verified(run_case):
    d = run_case("exploded")[0].to_json()
    diag = d["diagnosis"]
    assert "fc1.weight" in diag["explanation"] and "fc2.weight" in diag["explanation"]
    assert diag["fix"]["verified"] is None and "not replayed" in diag["fix"]["verification"]
    assert "clip_grad_norm_" in diag["fix"]["code"] and diag["fix"]["code"].startswith("# ")
    f64 = next(r for r in d["precision"] if r["dtype"] == "float64")
    assert f64["loss_finite"] is True and isinstance(f64["loss"], float) and f64["loss"] > 3.4e38


def test_unknown_pattern_gets_the_honest_generic_diagnosis(run_case):
    """i0 overflow: no rule knows it, so no fix is invented; what was seen and where is stated."""
    d = run_case("unknown_i0")[0].to_json()
    diag = d["diagnosis"]
    assert diag["cause"] == "unrecognised" and diag["fix"]["kind"] == "none" and diag["fix"]["verified"] is None
    expl = diag["explanation"]
    assert "aten.i0.default" in expl and f"causes.py:{causes.CASES.marker_line('unknown_i0')}" in expl
    assert "no specific rule" in expl


def test_autocast_fp16_fix_and_precision_probe(run_case):
    d = run_case("autocast_fp16")[0].to_json()
    assert d["model"]["autocast"] == {"device_type": "cpu", "dtype": "torch.float16"}
    rows = {r["dtype"]: r for r in d["precision"]}
    assert list(rows) == ["float32 (autocast off)", "autocast bfloat16", "float64"]
    assert all(r["loss_finite"] and r["grads_finite"] for r in rows.values())
    diag = d["diagnosis"]
    assert "under bfloat16 autocast" in diag["fix"]["verification"]
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in diag["fix"]["code"]
    assert "but not in autocast float16" in diag["explanation"]


def test_near_overflow_flagged_while_the_replay_is_finite(run_case):
    d = run_case("near_overflow")[0].to_json()
    assert d["verdict"] == "not_reproduced"
    (row,) = d["near_overflow"]
    assert row["module"] == "fc1" and row["dtype"] == "float16"
    assert row["ratio"] == pytest.approx(9600 / 65504)
    assert not next(a for a in d["activations"] if a["module"] == "fc2")["near_overflow"]
    assert "'fc1'" in d["diagnosis"]["explanation"] and "15% of float16" in d["diagnosis"]["explanation"]


def test_nan_activations_are_not_called_near_overflow(run_case):
    d = run_case("sqrt_cancellation")[0].to_json()
    head = next(a for a in d["activations"] if a["module"] == "head")
    assert head["absmax"] == "nan" and head["near_overflow"] is False
    assert d["near_overflow"] == []


def test_anomaly_sentence_later_node(run_case):
    """sqrt(0)' = Inf in SqrtBackward0; anomaly mode only raises where 0 * Inf = NaN, in PowBackward0."""
    d = run_case("sqrt_zero", module=nanmodels)[0].to_json()
    assert d["anomaly_mode"]["node"] == "PowBackward0" and d["anomaly_mode"]["agrees_with_culprit"] is False
    expl = d["diagnosis"]["explanation"]
    assert "would have raised at PowBackward0" in expl and "a later node than the culprit" in expl
    assert "the culprit made Inf, which anomaly mode does not check" in expl


def test_anomaly_sentence_forward_culprit_and_silence(run_case):
    expl = run_case("sqrt_cancellation")[0].diagnosis["explanation"]
    assert "would have raised only in backward, at AddmmBackward0" in expl
    expl = run_case("x_over_zero")[0].diagnosis["explanation"]
    assert "would have stayed silent" in expl
    expl = run_case("ce_all_ignored")[0].diagnosis["explanation"]
    assert "no backward node returned NaN" in expl


def test_rules_order_specific_before_generic():
    order = [r.cause for r in RULES]
    assert order.index("bce_saturated") < order.index("logsigmoid") < order.index("log_of_zero")
    assert order.index("handwritten_softmax") < order.index("exp_overflow")
    assert order[-1] == "unrecognised"


# ---------------------------------------------------------------- magnitude and range


def test_magnitude_provenance_names_the_exp(run_case):
    """A VAE fed raw pixels: exp(0.5 * logvar) makes a finite 1e30, mse_loss squares it past float32. The
    culprit stays mse_loss (by definition); the story, and the JSON, go back to the exp that made it huge."""
    d = run_case("vae_pixels")[0].to_json()
    assert d["culprit"]["op"] == "aten.mse_loss.default" and d["culprit"]["module"] == "<loss>"
    diag = d["diagnosis"]
    o = diag["magnitude_origin"]
    exp_line = next(i for i, t in enumerate(Path(causes.__file__).read_text().splitlines(), 1)
                    if t.rstrip().endswith("# MAGNITUDE: vae_exp"))
    assert o["op"] == "aten.exp.default" and o["source"]["line"] == exp_line and o["call"] == "torch.exp"
    assert o["output_absmax"] > 1e19 and o["input_absmax"] < 100 and o["growth"] > 1e17
    assert "made huge by aten.exp.default (torch.exp)" in diag["explanation"]
    assert f"causes.py:{exp_line}" in diag["explanation"]
    assert diag["fix"]["kind"] == "none" and diag["fix"]["verified"] is None


def test_exploded_weights_cover_nan_from_inf_minus_inf(run_case):
    """Weights of 3e19: LayerNorm's variance overflows inside the op and it returns NaN, not Inf."""
    d = run_case("exploded_norm")[0].to_json()
    assert d["culprit"]["kind"] == "nan" and d["culprit"]["role"] == "origin"
    diag = d["diagnosis"]
    assert diag["cause"] == "exploded_weights" and "fc.weight" in diag["explanation"]
    assert "inf − inf" in diag["explanation"]


def test_a_bfloat16_overflow_never_suggests_bfloat16(run_case):
    d = run_case("bf16_overflow")[0].to_json()
    diag = d["diagnosis"]
    assert d["culprit"]["inputs"][0]["dtype"] == "bfloat16" and diag["cause"] != "fp16_overflow"
    texts = [diag["fix"]["code"], *(a["code"] for a in diag["fix"]["alternatives"])]
    assert not any("bfloat16" in t or "bf16" in t for t in texts), texts


def test_no_grad_scaler_is_suggested_to_a_run_that_has_one(run_case):
    """A pure float16 model: without a GradScaler the untested alternatives include one; with the run's
    GradScaler (scale 1024, what a native snapshot's grad_scale becomes) they do not, and the text says why."""
    without = run_case("fp16", module=nanmodels)[0].to_json()["diagnosis"]
    assert any("GradScaler" in a["code"] for a in without["fix"]["alternatives"])
    d = run_case("fp16", module=nanmodels, subject={"loss_scale": 1024.0})[0].to_json()["diagnosis"]
    assert d["cause"] == "fp16_overflow"
    texts = [d["fix"]["code"], *(a["code"] for a in d["fix"]["alternatives"])]
    assert not any("GradScaler" in t for t in texts), texts
    assert "already uses a GradScaler (scale 1024)" in d["explanation"]


# ---------------------------------------------------------------- a second look


def test_a_masked_mean_over_no_token_is_not_a_zero_norm(run_case):
    d = run_case("masked_mean")[0].to_json()
    diag = d["diagnosis"]
    assert diag["cause"] == "masked_mean_empty" and "normalising" not in diag["explanation"]
    assert "(x * mask).sum() / mask.sum()" in diag["explanation"] and "selects nothing" in diag["explanation"]
    assert diag["fix"]["after"].startswith("masked = (per_token * mask).sum() / mask.sum().clamp_min(1)")
    model, (x, _) = causes.token_regressor(), causes.CASES["masked_mean"].batch()["x"]
    with torch.no_grad():
        main = ((model.fc(x).squeeze(-1) - 1.0) ** 2).mean().item()
    assert diag["fix"]["replay"]["loss"] == pytest.approx(main, rel=1e-6)  # the empty term counts 0


def test_variance_cancellation_under_an_eps_suggests_torch_var(run_case):
    """sqrt(var + 1e-5) with var = E[h²] − E[h]² cancelling below -1e-5: not "sqrt of a negative" with a clamp
    that hides the bug, but the cancellation, fixed with torch.var — the first candidate, and it verifies."""
    d = run_case("var_cancellation")[0].to_json()
    diag = d["diagnosis"]
    assert diag["cause"] == "sqrt_cancellation" and diag["fix"]["kind"] == "stable_variance"
    assert diag["fix"]["before"] == "var = (h * h).mean(-1, keepdim=True) - mu * mu"
    assert diag["fix"]["after"] == "var = torch.var(h, -1, keepdim=True, correction=0)"
    assert diag["candidates"][0] is not None and diag["candidates"][0]["kind"] == "stable_variance"
    assert diag["fix"]["verified"] is True and diag["fix"]["tested_as"] == "line"
    assert "hides the bug" in diag["explanation"]


def test_a_shared_denominator_is_fixed_where_it_is_made(run_case):
    """a = h / norm; b = h.pow(2) / norm, with norm 0 for one sample: a change at the culprit's quotient leaves the
    other NaN; the fix clamps the norm on the line that makes it, and the explanation names both uses."""
    res, _ = run_case("shared_zero_norm")
    diag = res.diagnosis
    fix = diag["fix"]
    assert fix["before"] == "norm = h.norm(dim=-1, keepdim=True)" and fix["after"].startswith(
        "norm = h.norm(dim=-1, keepdim=True).clamp_min("), fix
    line = causes.CASES.marker_line("shared_zero_norm")  # a = h / norm; the next line b, the line before it norm
    why = fix["reasoning"]
    assert "the value is used at " in why and f"causes.py:{line}, " in why and all(
        f"causes.py:{n}{end}" in why for n, end in ((line + 1, ": changed where it is made ("), (line - 1, ")"))), why
    site = [c for c in diag["candidates"] if c["before"] and c["before"].startswith("a = h / norm")]
    assert all(c["verified"] is not True for c in site), site  # the one-site patch alone does not verify
