"""The tightened zoo's judging (benchmarks/zoo_applied.py): its subset covers every fault kind on distinct
architectures, and its healthy-values check tells a fix that leaves the healthy samples alone from one that
moves them (the patched line made by realbugs/run.py's apply_fix, as the benchmark applies a suggested fix)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import zoo_applied  # noqa: E402
import zoo_faults  # noqa: E402


def test_the_subset_runs_every_kind_on_distinct_architectures():
    runs = zoo_applied.subset(list(zoo_faults.KINDS), zoo_applied.ARCHS, 2)
    assert {k for k, _, _ in runs} == set(zoo_faults.KINDS)
    assert set(zoo_applied.DEDICATED) == set(zoo_faults.KINDS)
    for kind in zoo_faults.KINDS:
        firsts = [order[0] for k, order, _ in runs if k == kind]
        assert len(set(firsts)) == 2, kind
        precs = [p for k, _, p in runs if k == kind]
        assert set(precs) == set(zoo_faults.KINDS[kind].precisions[:2]), kind


def _patched(tmp_path: Path, before: str, after: str):
    shutil.copy(BENCH / "zoo_faults.py", tmp_path / "zoo_faults.py")
    assert zoo_applied._run_py().apply_fix(tmp_path / "zoo_faults.py", before, after)
    import importlib.util
    spec = importlib.util.spec_from_file_location("zoo_faults_patched", tmp_path / "zoo_faults.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_healthy_values_check_accepts_a_no_op_fix_and_rejects_a_large_epsilon(tmp_path):
    line = "return x + 0.1 * torch.log(x.pow(2).mean(-1, keepdim=True))  # SITE: log_zero"
    small = _patched(tmp_path, line, line.replace("keepdim=True))", "keepdim=True) + 1e-12)"))
    h = zoo_applied._healthy_site(small, BENCH / "zoo_faults.py", "log_zero", "fp32")
    assert h["same"], h
    (tmp_path / "b").mkdir()
    large = _patched(tmp_path / "b", line, line.replace("keepdim=True))", "keepdim=True) + 0.5)"))
    h = zoo_applied._healthy_site(large, BENCH / "zoo_faults.py", "log_zero", "fp32")
    assert not h["same"] and h["moved"] > 1e-3, h
