"""`nanreplay triage DIR --ray`: the same tasks as Ray tasks on a (local) Ray cluster say what a local triage says."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import nanmodels
from nanreplay.cli import main

MODEL = ("--model", "nanmodels:three_causes", "--no-verify", "--jobs", "2")


def test_ray_tasks_group_as_one_process_does(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray", reason="needs ray: pip install 'nanreplay[ray]'")
    tests = str(Path(nanmodels.__file__).parent)  # the Ray workers import --model's module too: on their path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p))
    d = tmp_path / "snaps"
    d.mkdir()
    for k in range(4):
        nanmodels.save_three_causes(k % 3, d / f"nan_snapshot_step_{10 + k}_rank{k % 2}.pt", k + 1)
    shutil.copy(d / "nan_snapshot_step_10_rank0.pt", d / "a_copy.pt")
    (d / "broken.pt").write_bytes(b"not a snapshot")
    one, on_ray = tmp_path / "one", tmp_path / "ray"
    assert CliRunner().invoke(main, ["triage", str(d), "-o", str(one), *MODEL]).exit_code == 1
    try:
        res = CliRunner().invoke(main, ["triage", str(d), "-o", str(on_ray), *MODEL, "--ray"])
    finally:
        ray.shutdown()
    assert res.exit_code == 1, res.output  # broken.pt, as in the local run
    a, b = (json.loads((o / "groups.json").read_text()) for o in (one, on_ray))
    assert a["groups"] == b["groups"] and len(a["groups"]) == 3  # reports included: same names, same folder layout
    assert a["counts"] == b["counts"] and a["failures"] == b["failures"] and a["ranks"] == b["ranks"]
    for g in b["groups"]:
        for s in g["snapshots"]:
            assert (on_ray / s["report"]).is_file()

    res = CliRunner().invoke(main, ["triage", str(d), "-o", str(on_ray), *MODEL, "--ray"])  # all cached: no Ray
    assert res.exit_code == 1 and "(6 from cache)" in res.output, res.output
