from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
ROOT = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # `nanmodels:factory` specs resolve like a user's own package

import nanmodels  # noqa: E402


def _threads() -> int:
    """One intra-op thread (the tests share small machines) unless OMP_NUM_THREADS asks for more: .ci/run
    runs the whole suite again with OMP_NUM_THREADS=2 (and the math libraries forced to a lower code path), as no
    assertion may depend on it."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1").split(",")[0]))
    except ValueError:
        return 1


torch.set_num_threads(_threads())


@pytest.fixture
def snapshot_of(tmp_path):
    """Write a case's plain state-dict snapshot file and return its path."""
    def make(name: str) -> Path:
        return nanmodels.CASES[name].save(tmp_path / f"{name}_step_7.pt")
    return make


@pytest.fixture
def analyzed(snapshot_of):
    """Analyze a case from its snapshot file, exactly as `nanreplay analyze` would."""
    from nanreplay.analysis import analyze

    def run(name: str, **kw):
        c = nanmodels.CASES[name]
        return analyze(snapshot_of(name), model=c.model_spec, loss=c.loss, **kw).to_json()
    return run
