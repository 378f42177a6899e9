"""The CLI/JSON contract of ../shared/DESIGN.md: scripts and CI depend on these keys; never rename them."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from nanreplay.cli import main

VERDICTS = {"culprit_found", "nonfinite_input", "nonfinite_parameters", "not_reproduced"}
FIX_KINDS = {"epsilon", "clamp", "log_softmax", "logsigmoid", "xlogy", "bce_with_logits", "max_subtraction",
             "finite_mask_value", "double_where", "correction", "bf16_or_grad_scaler", "lower_lr_clip_grads",
             "clean_input", "restore_parameters", "guard_empty_reduction", "none"}


def check_contract(d: dict) -> None:
    assert d["schema"] == "nanreplay.analysis/1"
    assert isinstance(d["snapshot"], str) and d["verdict"] in VERDICTS
    c = d["culprit"]
    if d["verdict"] == "culprit_found":
        assert c["phase"] in ("forward", "backward") and c["kind"] in ("nan", "inf")
        assert c["op"].startswith("aten.") and isinstance(c["forward_op"], str)
        assert c["backward_node"] is None or isinstance(c["backward_node"], str)
        assert isinstance(c["module"], str)
        assert c["source"] is None or {"file", "line", "code"} <= set(c["source"])
        for st in c["inputs"]:
            assert {"shape", "dtype", "min", "max", "zeros", "negatives", "nan", "inf"} <= set(st)
        assert set(c["output"]) >= {"numel", "nan", "posinf", "neginf"}
    else:
        assert c is None
    for e in d["chain"]:
        assert {"phase", "kind", "op", "module", "role"} <= set(e)
        assert e["role"] in ("literal", "origin", "conversion", "propagation")
    for leaf in d["nonfinite_leaves"]:
        assert {"name", "role", "nan", "inf"} <= set(leaf)
    assert {"raises", "node", "agrees_with_culprit"} <= set(d["anomaly_mode"])
    diag = d["diagnosis"]
    assert {"cause", "title", "explanation", "fix"} <= set(diag)
    assert {"kind", "code", "epsilon", "verified"} <= set(diag["fix"])
    assert diag["fix"]["kind"] in FIX_KINDS and diag["fix"]["verified"] in (True, False, None)


@pytest.mark.parametrize("case", ["sqrt_zero", "healthy_mask", "masked_row"])
def test_json_on_stdout_keeps_the_contract(snapshot_of, case):
    import nanmodels

    c = nanmodels.CASES[case]
    args = ["analyze", str(snapshot_of(case)), "--model", c.model_spec, "--json", "-", "-o",
            str(snapshot_of(case).with_suffix(".html"))] + (["--loss", c.loss] if c.loss else [])
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    check_contract(json.loads(res.stdout))


def test_leaf_verdicts_keep_the_contract(tmp_path):
    import torch

    import nanmodels
    from nanreplay.analysis import analyze

    model = nanmodels.tiny()
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    torch.save({"x": x, "y": torch.tensor([0, 1, 0]), "state": model.state_dict()}, tmp_path / "s.pt")
    d = analyze(tmp_path / "s.pt", model="nanmodels:tiny", loss="cross_entropy").to_json()
    check_contract(d)
    assert d["verdict"] == "nonfinite_input"
