"""`--source` does what its help says: without it no local file is read (not even in the current folder) and paths
show as the snapshot recorded them — for the shipped samples, relative to the repository."""

from __future__ import annotations

import json
import shutil

from clirun import run

from nanreplay.cli import main
from samples import ROOT

SAMPLE = ROOT / "sample_snapshots" / "sqrt_zero.pt"


def test_help_says_the_current_folder_is_not_read():
    from click.testing import CliRunner

    text = " ".join(CliRunner().invoke(main, ["analyze", "--help"]).output.split())
    assert "[default: none: no local file is read, not even in the current folder;" in text
    assert "default: the current folder" not in text


def test_without_source_nothing_local_is_read_and_the_sample_shows_its_repository_path(tmp_path):
    # the current folder holds the very file the snapshot recorded, line for line
    (tmp_path / "sample_snapshots").mkdir()
    shutil.copy(ROOT / "sample_snapshots" / "models.py", tmp_path / "sample_snapshots" / "models.py")
    res = run("analyze", SAMPLE, "--no-report", "--json", "-", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    src = json.loads(res.stdout)["culprit"]["source"]
    assert (src["file"], src["line"], src["path"]) == ("sample_snapshots/models.py", 23, None)
    module = next(ln for ln in res.stderr.splitlines() if ln.startswith("  module"))
    assert module.endswith("at sample_snapshots/models.py:23") and str(ROOT) not in module

    res = run("analyze", SAMPLE, "--no-report", "--json", "-", "--source", ".", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    src = json.loads(res.stdout)["culprit"]["source"]
    assert src["file"] == "sample_snapshots/models.py" and src["path"] == str(tmp_path / "sample_snapshots/models.py")
