"""Every shipped sample snapshot gets the right culprit and a fix verified by replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_snapshots"

# sample -> (flags, culprit op, phase, cause)
EXPECTED = {
    "sqrt_zero": (["--model", "sample_snapshots.models:triplet"], "aten.div.Tensor", "backward", "sqrt_at_zero"),
    "log_zero": (["--model", "sample_snapshots.models:poisson"], "aten.log.default", "forward", "log_of_zero"),
    "sqrt_negative": (["--model", "sample_snapshots.models:std_scaler", "--loss", "mse_loss"], "aten.sqrt.default",
                      "forward", "sqrt_of_negative"),
    "zero_norm": (["--model", "sample_snapshots.models:retriever", "--loss", "cross_entropy"], "aten.div.Tensor",
                  "forward", "normalize_zero_norm"),
    "zero_log_zero": (["--model", "sample_snapshots.models:entropy_gate"], "aten.log.default", "forward",
                      "zero_times_log_zero"),
    "log_softmax": (["--model", "sample_snapshots.models:overconfident", "--loss", "nll_loss"], "aten.div.Tensor",
                    "backward", "log_softmax"),
    "fp16_overflow": (["--model", "sample_snapshots.models:half_mlp", "--loss", "mse_loss"], "aten.addmm.default",
                      "forward", "fp16_overflow"),
}


def test_every_sample_is_covered():
    assert {p.stem for p in SAMPLES.glob("*.pt")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample(name, tmp_path):
    from nanreplay.analysis import analyze

    flags, op, phase, cause = EXPECTED[name]
    opts = dict(zip([f.lstrip("-") for f in flags[::2]], flags[1::2], strict=True))
    d = analyze(SAMPLES / f"{name}.pt", **opts).to_json()
    assert d["verdict"] == "culprit_found"
    assert (d["culprit"]["op"], d["culprit"]["phase"]) == (op, phase)
    assert d["culprit"]["source"]["file"].endswith("models.py")
    assert d["diagnosis"]["cause"] == cause
    assert d["diagnosis"]["fix"]["verified"] is True


def test_cli_end_to_end_in_a_fresh_process(tmp_path):
    """The README's main command, in a subprocess, from the repository root."""
    out = tmp_path / "report.html"
    res = subprocess.run([sys.executable, "-m", "nanreplay.cli", "analyze", "sample_snapshots/sqrt_zero.pt",
                          "--model", "sample_snapshots.models:triplet", "-o", str(out), "--json", "-"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["culprit"]["backward_node"] == "SqrtBackward0"
    assert out.exists() and "SqrtBackward0" in out.read_text()


def test_ci_runs_the_readme_commands():
    """.ci/run must install and test exactly as the README says."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:3]]
    assert blocks[1] in ci
    assert blocks[0].startswith(blocks[1].rsplit("&&", 1)[0].strip())
