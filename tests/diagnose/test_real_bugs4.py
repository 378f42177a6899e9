"""Families the fourth real-bug round found (benchmarks/realbugs: logdet_covariance_head).

* torch.logdet of a predicted covariance that is not positive definite (stepankonev/waymo-motion-prediction-
  challenge-2022-multipath-plus-plus#9): logdet is where(sign == -1, nan, log|det|) over slogdet, so the culprit is
  the NaN constant on the logdet line, and the step used to be "unrecognised". It is now named, and the advice is
  the parameterisation (a Cholesky factor, L Lᵀ): no line change at logdet is exact, and slogdet's logabsdet would
  be finite but the likelihood of an indefinite matrix is unbounded below.
* the log of a product of many probabilities (allenai/allennlp-reading-comprehension-research#5), made on the line
  above: the product underflows to 0 with no factor 0, and the ε the log used to get moved every healthy value of
  the loss (applied, "healthy values changed"); the fix is the sum of the logs, on both lines.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

import realbugs4_cases
import torch

from tolerance import close


@contextlib.contextmanager
def _fixed_module(fix: dict, name: str, tmp_path: Path, monkeypatch):
    """realbugs4_cases with every edit of `fix` applied as shown (each `before` must be there), imported as `name`."""
    src = Path(realbugs4_cases.__file__).read_text()
    for e in fix["edits"]:
        assert e["before"] in src, e
        src = src.replace(e["before"], e["after"], 1)
    (tmp_path / f"{name}.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)


def test_logdet_of_an_indefinite_covariance_is_named_and_advised(run_case):
    res, _ = run_case("logdet_indefinite", module=realbugs4_cases)
    d = res.to_json()
    assert d["verdict"] == "culprit_found"
    assert d["culprit"]["source"]["line"] == realbugs4_cases.CASES.marker_line("logdet")
    diag = d["diagnosis"]
    assert diag["cause"] == "logdet_not_positive_definite", diag["title"]
    assert diag["fix"]["kind"] == "positive_definite" and not diag["fix"]["edits"]
    assert diag["fix"]["verified"] is None  # advice: nothing replayed, nothing claimed
    assert "L @ L.mT" in diag["fix"]["code"] and "scale_tril" in diag["fix"]["code"]
    # the matrix's own line is named: that is where the parameterisation changes
    assert f":{realbugs4_cases.CASES.marker_line('matrix')}" in diag["explanation"]


def test_log_of_a_product_made_on_the_line_above_becomes_a_sum_of_logs(run_case, tmp_path, monkeypatch):
    """log(p.prod(d)) across two lines: the product line makes the sum of the logs instead, the log line reads it;
    applied, the underflowed batch is finite and a healthy one (20 factors) keeps its value."""
    res, _ = run_case("log_of_product", module=realbugs4_cases)
    d = res.to_json()
    assert d["culprit"]["source"]["line"] == realbugs4_cases.CASES.marker_line("logprod")
    diag = d["diagnosis"]
    assert diag["cause"] == "log_of_product_underflow", diag["title"]
    fix = diag["fix"]
    assert fix["kind"] == "sum_of_logs" and fix["verified"] is True, fix["verification"]
    assert [e["line"] for e in fix["edits"]] == [realbugs4_cases.CASES.marker_line(m) for m in ("prod", "logprod")]
    with _fixed_module(fix, "realbugs4_fixed", tmp_path, monkeypatch) as fixed:
        for n in (100, 20):
            b = realbugs4_cases.product_batch(n)
            new = fixed.combination_likelihood()(b["x"])
            assert torch.isfinite(new), n
            if n == 20:  # healthy: the product did not underflow, and the sum of logs is the same value
                old = realbugs4_cases.combination_likelihood()(b["x"])
                assert close(new.item(), old.item()), (new.item(), old.item())


def test_kl_div_with_a_softmax_target_that_underflowed_takes_log_target(run_case, tmp_path, monkeypatch):
    """Reverse-KL with the student's softmax as kl_div's target: the loss is finite, the target's derivative
    log(0) is not. The fix gives kl_div the log-probabilities (log_target=True), on both lines; applied, the
    gradients are finite and the loss is the same value."""
    res, _ = run_case("reverse_kl", module=realbugs4_cases)
    d = res.to_json()
    assert d["culprit"]["source"]["line"] == realbugs4_cases.CASES.marker_line("kldiv")
    diag = d["diagnosis"]
    assert diag["cause"] == "kl_div_target_zero", diag["title"]
    fix = diag["fix"]
    assert fix["kind"] == "log_target" and fix["verified"] is True, fix["verification"]
    assert [e["line"] for e in fix["edits"]] == [realbugs4_cases.CASES.marker_line(m) for m in ("softmax", "kldiv")]
    with _fixed_module(fix, "realbugs4_kl_fixed", tmp_path, monkeypatch) as fixed:
        b = realbugs4_cases.kl_batch()
        old, new = realbugs4_cases.reverse_kl(), fixed.reverse_kl()
        lo, ln = old(b["x"]), new(b["x"])
        ln.backward()
        assert all(torch.isfinite(p.grad).all() for p in new.parameters())
        assert close(ln.item(), lo.item()), (ln.item(), lo.item())


def test_log_of_a_cumulative_product_becomes_a_cumulative_sum_of_logs(run_case):
    """A survival curve, cumprod(1 - hazard), logged: the same family on one line, cumsum for cumprod."""
    res, _ = run_case("log_of_cumprod", module=realbugs4_cases)
    diag = res.to_json()["diagnosis"]
    assert diag["cause"] == "log_of_product_underflow", diag["title"]
    fix = diag["fix"]
    assert fix["verified"] is True, fix["verification"]
    assert fix["after"].startswith("return -torch.log(keep).cumsum(dim=1).mean()"), fix["after"]
