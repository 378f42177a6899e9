"""Sharded-snapshot tests: one 2-rank gloo training run (torch.distributed.run) per session writes a snapshot
folder per scenario (see fsdp_steps.py); the tests analyze copies of them. Every test here is marked
`distributed` (deselect with -m "not distributed")."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
SCENARIOS = ("a", "b", "c", "d", "r", "w")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(pytest.mark.distributed)


def gloo() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_gloo_available()


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, dict]:
    """scenario -> {"folder": the snapshot folder, "lines": what each rank printed (rank, step, path, error)}."""
    if not gloo():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("fsdp_runs")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           str(HERE / "fsdp_steps.py"), str(out), *SCENARIOS]
    res = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    found: dict[str, dict] = {s: {"lines": {}} for s in SCENARIOS}
    text = "".join((out / f"rank{r}.txt").read_text() for r in (0, 1))
    for m in re.finditer(r"^RESULT (\w) (\d) (\d+) (\S+) (.*)$", text, re.M):
        s, rank, step, path, error = m.groups()
        found[s]["lines"][int(rank)] = {"step": int(step), "path": path, "error": error}
    for s, d in found.items():
        paths = {v["path"] for v in d["lines"].values()}
        assert len(d["lines"]) == 2 and len(paths) == 1, (s, d, text)
        d["folder"] = Path(paths.pop())
    return found


@pytest.fixture
def folder(runs, tmp_path):
    """A private copy of a scenario's snapshot folder (tests may damage it)."""
    def copy(scenario: str) -> Path:
        src = runs[scenario]["folder"]
        dst = tmp_path / scenario / src.name
        shutil.copytree(src, dst)
        return dst
    return copy
