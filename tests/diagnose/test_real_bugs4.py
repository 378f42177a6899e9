"""Families the fourth real-bug round found (benchmarks/realbugs: logdet_covariance_head).

* torch.logdet of a predicted covariance that is not positive definite (stepankonev/waymo-motion-prediction-
  challenge-2022-multipath-plus-plus#9): logdet is where(sign == -1, nan, log|det|) over slogdet, so the culprit is
  the NaN constant on the logdet line, and the step used to be "unrecognised". It is now named, and the advice is
  the parameterisation (a Cholesky factor, L Lᵀ): no line change at logdet is exact, and slogdet's logabsdet would
  be finite but the likelihood of an indefinite matrix is unbounded below.
"""

from __future__ import annotations

import realbugs4_cases


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
