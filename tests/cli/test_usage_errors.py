"""Each common mistake gets one line that says what to do — and the usage errors answer before torch is imported.

The mistakes a new user makes first: a file that is not there, a folder of snapshots given to analyze, a
`--model` spelled as a file path, a bare `torch.save(model.state_dict())`, a truncated copy, a plain dict
whose `x` is one tensor for a two-argument forward.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from clirun import one_line_error, run

import nanmodels
from samples import ROOT, SAMPLES

# torch made unimportable: a usage error that needed it would show an ImportError instead of its line
NO_TORCH = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['nanreplay', *sys.argv[1:]]; "
            "runpy.run_module('nanreplay.cli', run_name='__main__')")


def _without_torch(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", NO_TORCH, *map(str, args)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    return res, time.perf_counter() - t0


def _one_line(res, code: int, *needles: str) -> str:
    assert res.returncode == code, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args,needles", [
    (["analyze", "missing.pt"], ["missing.pt: no such file"]),
    (["analyze", "{snaps}"], ["not a sharded snapshot", "holds 2 snapshot files", "nanreplay triage"]),
    (["analyze", "{snap}", "--model", "sample_snapshots/models.py:triplet"],
     ["a file path", "--model sample_snapshots.models:triplet"]),
    (["analyze", "{snap}", "--model", "nanmodels"], ["expected MODULE:NAME"]),
    (["analyze", "{snap}", "--loss", "a/b.py:f"], ["--loss 'a/b.py:f'", "--loss a.b:f"]),
    (["analyze", "{snap}", "-o", "{snaps}"], ["-o", "is a directory"]),
    (["analyze", "{snap}", "--json", "{snap}"], ["refusing to overwrite the snapshot"]),
    (["triage", "{snaps}", "--model", "models/net.py:build"], ["a file path", "models.net:build"]),
])
def test_usage_errors_answer_before_torch_is_imported(tmp_path, args, needles):
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    for n in ("log_zero", "sqrt_zero"):
        (snaps / f"{n}.pt").write_bytes((SAMPLES / f"{n}.pt").read_bytes())
    args = [a.format(snaps=snaps, snap=snaps / "log_zero.pt") for a in args]
    res, took = _without_torch(tmp_path, *args)
    line = _one_line(res, 2, *needles)
    assert line.startswith("nanreplay: error: "), line
    if args[1] == "missing.pt":
        assert took < 5  # measured: 0.25 s (0.17 s of CPU) where torch's import alone takes 4-7 s


def test_a_folder_that_is_not_a_sharded_snapshot_says_so_first(tmp_path):
    line = one_line_error(run("analyze", tmp_path), 2, "nanreplay triage")
    assert line.split(f"{tmp_path}: ", 1)[1].startswith("not a sharded snapshot"), line


def test_a_bare_state_dict_says_it_holds_only_weights_and_how_to_save_the_batch(tmp_path):
    p = tmp_path / "weights.pt"
    torch.save(nanmodels.siamese().state_dict(), p)
    one_line_error(run("analyze", p, "--model", "nanmodels:siamese"), 2, "holds only a model's weights",
                   "the batch", "NanGuard", "torch.save({'x': x, 'y': y, 'state': model.state_dict()}, path)")


def test_a_truncated_file_ends_its_sentence(tmp_path):
    data = (SAMPLES / "sqrt_zero.pt").read_bytes()
    for cut in (len(data) // 10, len(data) // 2):  # two ways torch.load fails: no central directory, a bad seek
        p = tmp_path / f"cut{cut}.pt"
        p.write_bytes(data[:cut])
        line = one_line_error(run("analyze", p), 2, "corrupt or truncated snapshot", "cut short or damaged")
        assert line.endswith("copy it again from where it was written") and "…" not in line, line


def test_one_tensor_for_a_two_argument_forward_names_the_file_and_model_star_x(tmp_path):
    m = nanmodels.siamese()
    p = tmp_path / "pair.pt"
    torch.save({"x": torch.randn(4, 8), "y": torch.zeros(4), "state": m.state_dict()}, p)
    one_line_error(run("analyze", p, "--model", "nanmodels:siamese"), 2, str(p), "'x' holds one tensor",
                   "passed as model(x)", "takes 2 arguments", "model(*x)")


def test_another_models_dict_is_told_so_not_how_to_save_its_inputs(tmp_path):
    """The seed's dict of one model analyzed with another (two-argument) model: the weights do not fit, and that is
    what is said — not "save one input per argument as a tuple", which would not help."""
    other = nanmodels.tiny()
    p = tmp_path / "other.pt"
    torch.save({"x": torch.randn(2, 4), "y": torch.zeros(2), "state": other.state_dict()}, p)
    line = one_line_error(run("analyze", p, "--model", "nanmodels:siamese"), 2, str(p), "its weights are not",
                          "does not fit", "another model", "--model")
    assert "one input per argument" not in line


def test_torchs_broadcast_warning_is_not_repeated_by_the_replay(tmp_path, monkeypatch):
    """A loss whose target broadcasts (output [8, 1], target [8]): torch warns in training; the replay's own calls
    of the step would repeat it, attributed to nanreplay's lines (replay/recorder.py), on the analyst's terminal."""
    import warnings

    import torch.nn.functional as F

    from nanreplay.analysis import analyze

    (tmp_path / "bcast_model.py").write_text(
        "import torch, torch.nn as nn\n\n\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.l = nn.Linear(4, 1)\n\n    def forward(self, x):\n        return torch.log(self.l(x) - self.l(x))\n"
        "\n\ndef build():\n    torch.manual_seed(0)\n    return M()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import bcast_model

    torch.save({"x": torch.randn(8, 4), "y": torch.zeros(8), "state": bcast_model.build().state_dict()},
               tmp_path / "b.pt")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        F.mse_loss(torch.zeros(8, 1), torch.zeros(8))  # what training saw
        assert any("target size" in str(w.message) for w in seen)
        seen.clear()
        d = analyze(tmp_path / "b.pt", model="bcast_model:build", loss="mse_loss", verify=False).to_json()
    assert d["culprit"]["op"] == "aten.log.default"
    assert not [w for w in seen if "target size" in str(w.message)], [str(w.message) for w in seen]
