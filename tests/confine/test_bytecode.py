"""The confined child runs with -B (it may write nothing outside its outputs), so the parent compiles nanreplay's
bytecode where Python may write it: an editable install's analysis stops compiling ~140 modules from source in
every child. PYTHONDONTWRITEBYTECODE is obeyed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from samples import ROOT, SAMPLES


def _analyze_with_a_copy(tmp_path, **env) -> tuple:
    pkg = tmp_path / "src" / "nanreplay"
    shutil.copytree(ROOT / "nanreplay", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run([sys.executable, "-c", "from nanreplay.cli import main; main()", "analyze",
                          str(SAMPLES / "sqrt_zero.pt"), "--no-report", "-q"], cwd=tmp_path,
                         env={**base, "PYTHONPATH": str(tmp_path / "src"), **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return pkg, sorted(p.name.split(".")[0] for p in pkg.rglob("*.pyc"))


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the confined analysis needs Linux")
def test_the_parent_compiles_what_the_child_imports(tmp_path):
    pkg, compiled = _analyze_with_a_copy(tmp_path)
    # modules only the child imports (the replay, the formats, the diagnosis), not only the CLI's own
    assert {"native", "recorder", "engine", "pipeline"} <= set(compiled), compiled
    assert len(compiled) == sum(1 for _ in pkg.rglob("*.py"))


def test_no_bytecode_where_the_user_said_so(tmp_path):
    _, compiled = _analyze_with_a_copy(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    assert compiled == []
