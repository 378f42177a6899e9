"""The culprit on purpose-built models: one per real-world NaN/Inf pattern."""

from __future__ import annotations

import json

import pytest

import nanmodels

CULPRIT_CASES = [n for n, c in nanmodels.CASES.items() if c.expect.get("verdict", "culprit_found") == "culprit_found"]


@pytest.mark.parametrize("name", CULPRIT_CASES)
def test_culprit_is_named_exactly(analyzed, name):
    exp = nanmodels.CASES[name].expect
    d = analyzed(name, verify=False)
    assert d["verdict"] == "culprit_found"
    c = d["culprit"]
    for key in ("phase", "kind", "op", "forward_op", "module"):
        if key in exp:
            assert c[key] == exp[key], (key, c[key])
    assert c["backward_node"] == exp.get("backward_node")
    assert c["source"]["line"] == nanmodels.CASES.marker_line(name)
    assert c["source"]["file"].endswith("nanmodels.py")
    assert "CULPRIT" in c["source"]["code"]
    if "role" in exp:
        assert c["role"] == exp["role"]
    else:
        assert c["role"] == "origin"
    if "anomaly" in exp:
        assert d["anomaly_mode"]["raises"] is exp["anomaly"]
    if "agrees" in exp:
        assert d["anomaly_mode"]["agrees_with_culprit"] is exp["agrees"]
    if "failure" in exp:
        assert d["failure"]["what"] == exp["failure"]
    # the culprit is on the chain, and the chain ends at the failure
    assert d["chain"][-1]["index"] == d["failure"]["event"]
    assert c["event"] in [e["index"] for e in d["chain"]]
    json.dumps(d, allow_nan=False)  # strict JSON, no NaN/Infinity literals


def test_inf_then_nan_anomaly_blames_a_later_node(analyzed):
    """sqrt(0)' = Inf in SqrtBackward0; 0*Inf = NaN only in PowBackward0: anomaly mode blames the latter."""
    d = analyzed("sqrt_zero", verify=False)
    assert d["culprit"]["backward_node"] == "SqrtBackward0" and d["culprit"]["kind"] == "inf"
    assert d["anomaly_mode"] == {**d["anomaly_mode"], "raises": True, "node": "PowBackward0",
                                 "agrees_with_culprit": False}
    kinds = [(e["backward_node"], e["role"]) for e in d["chain"]]
    assert ("SqrtBackward0", "origin") in kinds and ("PowBackward0", "conversion") in kinds


def test_inf_trap_finite_loss_infinite_gradient(analyzed):
    d = analyzed("inf_trap", verify=False)
    assert d["failure"] == {**d["failure"], "what": "gradient", "name": "g", "kind": "inf"}
    assert isinstance(d["loss"], float)
    assert d["anomaly_mode"]["raises"] is False  # anomaly mode is blind to Inf
    g = next(r for r in d["gradients"] if r["name"] == "g")
    assert g["inf"] == 1


def test_healthy_causal_mask_is_never_the_culprit(analyzed):
    d = analyzed("healthy_mask", verify=False)
    assert d["verdict"] == "not_reproduced"
    assert d["culprit"] is None and d["chain"] == []


def test_fully_masked_row_blames_softmax_not_the_mask(analyzed):
    d = analyzed("masked_row", verify=False)
    first = d["chain"][0]
    assert (first["op"], first["role"]) == ("aten.masked_fill.Scalar", "literal")
    assert d["culprit"]["op"] == "aten._softmax.default" and d["culprit"]["role"] == "conversion"


def test_where_trap_forward_inf_is_not_the_culprit(analyzed):
    d = analyzed("where_trap", verify=False)
    assert d["culprit"]["phase"] == "backward"
    # the forward log(0) = -inf exists, but where() discarded it: it is not on the chain
    assert all(e["phase"] == "backward" for e in d["chain"])


def test_zero_times_log_zero_blames_log_not_the_product(analyzed):
    d = analyzed("zero_log_zero", verify=False)
    chain = [(e["op"], e["role"]) for e in d["chain"]]
    assert chain[0] == ("aten.log.default", "origin")
    assert ("aten.mul.Tensor", "conversion") in chain
    assert d["failure"]["kind"] == "nan" and d["culprit"]["kind"] == "inf"


def test_culprit_input_statistics(analyzed):
    d = analyzed("log_zero", verify=False)
    (x,) = d["culprit"]["inputs"]
    assert x["zeros"] > 0 and x["negatives"] == 0 and x["nan"] == 0 and x["inf"] == 0
    assert x["min"] == 0.0 and x["dtype"] == "float32" and x["shape"] == [8, 3]
    assert d["culprit"]["output"]["neginf"] == x["zeros"]


def test_not_reproduced_never_invents_a_culprit(tmp_path):
    import torch

    from nanreplay.analysis import analyze

    model = nanmodels.tiny()
    torch.save({"x": torch.randn(3, 4), "y": torch.randint(0, 2, (3,)), "state": model.state_dict()},
               tmp_path / "s.pt")
    d = analyze(tmp_path / "s.pt", model="nanmodels:tiny", loss="cross_entropy").to_json()
    assert d["verdict"] == "not_reproduced" and d["culprit"] is None
    assert d["diagnosis"]["cause"] == "not_reproduced"
