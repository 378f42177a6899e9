"""`nanreplay analyze` on the command line: outputs, exit codes, one clear line per bad input, the README's commands.

`nanreplay triage` is tested in tests/triage/: that command is the triage package's only entrance, and its
tests check grouping, caching and timeouts, with the CLI only as the driver.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from clirun import one_line_error, run

import nanmodels
from samples import ROOT


def test_json_to_stdout_and_default_report(snapshot_of, tmp_path):
    snap = snapshot_of("sqrt_zero")
    res = run("analyze", snap, "--model", "nanmodels:siamese", "--json", "-", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["schema"] == "nanreplay.analysis/1" and d["snapshot"] == str(snap)
    assert d["verdict"] == "culprit_found" and d["culprit"]["backward_node"] == "SqrtBackward0"
    report = tmp_path / f"{snap.stem}.nanreplay.html"
    assert report.exists() and "SqrtBackward0" in report.read_text()
    assert str(report.name) in res.stderr  # the summary goes to stderr when stdout carries JSON


def test_terminal_summary_and_paths(snapshot_of, tmp_path):
    snap = snapshot_of("log_softmax")
    out = tmp_path / "r.html"
    js = tmp_path / "a.json"
    res = run("analyze", snap, "--model", "nanmodels:classifier", "--loss", "nll_loss", "-o", out, "--json", js)
    assert res.exit_code == 0, res.output
    assert "LogBackward0" in res.stdout and "nanmodels.py:" in res.stdout and str(out) in res.stdout
    assert "verified by replay" in res.stdout
    assert json.loads(js.read_text())["diagnosis"]["cause"] == "log_softmax"
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave nothing behind


def test_missing_file(tmp_path):
    one_line_error(run("analyze", tmp_path / "nope.pt", "--model", "nanmodels:tiny"), 2, "no such file")


def test_not_a_snapshot(tmp_path):
    p = tmp_path / "notes.pt"
    p.write_text("hello")
    one_line_error(run("analyze", p, "--model", "nanmodels:tiny"), 2, "not a snapshot")
    q = tmp_path / "empty.pt"
    q.write_bytes(b"")
    one_line_error(run("analyze", q, "--model", "nanmodels:tiny"), 2, "empty file")


def test_truncated_snapshot(snapshot_of, tmp_path):
    snap = snapshot_of("log_zero")
    data = snap.read_bytes()
    bad = tmp_path / "cut.pt"
    bad.write_bytes(data[: len(data) // 2])
    one_line_error(run("analyze", bad, "--model", "nanmodels:log_likelihood"), 2, "corrupt or truncated")


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_that_needs_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    p = tmp_path / "evil.pt"
    torch.save({"x": torch.ones(1, 4), "state": {}, "payload": Evil(str(marker))}, p)
    err = one_line_error(run("analyze", p, "--model", "nanmodels:tiny"), 2, "--trust", "refusing")
    assert "open" in err or "builtins" in err
    assert not marker.exists()


def test_wrong_dict(tmp_path):
    p = tmp_path / "w.pt"
    torch.save({"weights": torch.ones(2)}, p)
    one_line_error(run("analyze", p, "--model", "nanmodels:tiny"), 2, "not a recognised snapshot", "weights")


@pytest.mark.parametrize("spec,needle", [
    ("no_such_pkg.models:build", "cannot import module 'no_such_pkg'"),
    ("nanmodels:nope", "has no attribute 'nope'"),
    ("nanmodels", "expected MODULE:NAME"),
    ("nanmodels:CASES", "not callable"),
])
def test_bad_model_spec(snapshot_of, spec, needle):
    one_line_error(run("analyze", snapshot_of("log_zero"), "--model", spec), 2, needle)


def raising_factory():
    raise ValueError("config file missing")


def test_factory_that_raises(snapshot_of):
    one_line_error(run("analyze", snapshot_of("log_zero"), "--model", f"{__name__}:raising_factory"), 2,
                   "factory raised ValueError: config file missing")


def test_state_dict_that_does_not_fit(snapshot_of):
    err = one_line_error(run("analyze", snapshot_of("log_zero"), "--model", "nanmodels:tiny"), 2,
                         "does not fit the model")
    assert "shape mismatch: fc.weight (snapshot [3, 4], model [2, 4])" in err


def test_unknown_loss(snapshot_of):
    one_line_error(run("analyze", snapshot_of("sqrt_neg"), "--model", "nanmodels:with_scale", "--loss", "mse_los"),
                   2, "--loss 'mse_los'")


def test_non_scalar_output_without_loss(snapshot_of):
    one_line_error(run("analyze", snapshot_of("sqrt_neg"), "--model", "nanmodels:with_scale"), 2,
                   "not a scalar loss", "--loss")


def test_model_that_raises_in_forward(tmp_path):
    model = nanmodels.tiny()
    p = tmp_path / "s.pt"
    torch.save({"x": torch.randn(3, 7), "state": model.state_dict()}, p)  # 7 features for a 4-feature model
    err = one_line_error(run("analyze", p, "--model", "nanmodels:tiny", "--loss", "cross_entropy"), 1,
                         "forward pass raised RuntimeError")
    assert "module 'fc'" in err


def test_never_overwrites_the_snapshot(snapshot_of):
    snap = snapshot_of("log_zero")
    before = snap.read_bytes()
    one_line_error(run("analyze", snap, "--model", "nanmodels:log_likelihood", "-o", snap), 2, "refusing")
    assert snap.read_bytes() == before


def test_output_folder_must_exist(snapshot_of, tmp_path):
    one_line_error(run("analyze", snapshot_of("log_zero"), "--model", "nanmodels:log_likelihood", "-o",
                       tmp_path / "missing" / "r.html"), 2, "does not exist")


def test_bad_device(snapshot_of):
    one_line_error(run("analyze", snapshot_of("log_zero"), "--model", "nanmodels:log_likelihood", "--device",
                       "warp9"), 2, "--device")


def test_global_state_restored_even_when_replay_raises(tmp_path):
    from nanreplay.analysis import analyze
    from nanreplay.errors import AnalysisError

    model = nanmodels.tiny()
    p = tmp_path / "s.pt"
    torch.save({"x": torch.randn(3, 7), "state": model.state_dict()}, p)
    mod = torch.nn.modules.module
    hooks = (len(mod._global_forward_hooks), len(mod._global_forward_pre_hooks))
    torch.autograd.set_detect_anomaly(True)
    try:
        with pytest.raises(AnalysisError):
            analyze(p, model="nanmodels:tiny", loss="cross_entropy")
        assert torch.is_anomaly_enabled()
    finally:
        torch.autograd.set_detect_anomaly(False)
    assert (len(mod._global_forward_hooks), len(mod._global_forward_pre_hooks)) == hooks
    assert not torch._C._is_torch_function_mode_enabled()
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    assert _get_current_dispatch_mode() is None


# ---------------------------------------------------------------- the README's commands


def test_cli_end_to_end_in_a_fresh_process(tmp_path):
    """The README's main command, in a subprocess, from the repository root."""
    out = tmp_path / "report.html"
    res = subprocess.run([sys.executable, "-m", "nanreplay.cli", "analyze", "sample_snapshots/sqrt_zero.pt",
                          "-o", str(out), "--json", "-"],
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
    # the first sets up a fresh machine with the package alone (no test extra) and analyzes a sample; the
    # second sets up the same way with the test extra and runs the tests
    setup, test_setup = blocks[0].rsplit("&&", 1)[0].strip(), blocks[1].rsplit("&&", 1)[0].strip()
    assert test_setup == setup.replace(" -e .", " -e '.[test]'") and "[test]" not in setup
    assert blocks[0].rsplit("&&", 1)[1].strip() == ".venv/bin/nanreplay analyze sample_snapshots/sqrt_zero.pt"


def test_the_readme_starts_where_the_user_is():
    """Its first 100 lines hold the install, the sample analysis, the guard loop and the plain-dict snapshot;
    every link is into the repository and its target exists."""
    import re

    readme = (ROOT / "README.md").read_text()
    head = "\n".join(readme.splitlines()[:100])
    for needle in ("pip install", "nanreplay analyze sample_snapshots/sqrt_zero.pt", "<!-- guard-loop -->",
                   "guard.grads_ok()", "torch.save({'x': x, 'y': y, 'state': model.state_dict()}", "--model",
                   "nanreplay triage", "NanGuardCallback", "guard_for", "](docs/"):
        assert needle in head, needle
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for link in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            assert "://" not in link and (doc.parent / link).resolve().is_relative_to(ROOT), (doc.name, link)
            assert (doc.parent / link).exists(), (doc.name, link)
