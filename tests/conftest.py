from __future__ import annotations

import os
import signal
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

# set by imports, not by a test: torch._dynamo's names its cache folder the first time any test imports it
_ENV_IGNORED = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


def _global_state() -> dict:
    """What one test could leave changed in the process for the tests after it: with `--dist loadfile` and in
    whatever order files run, a test that meets it passes or fails by who ran before it (docs/testing.md)."""
    from nanreplay import torch_internals as ti

    mm = torch.nn.modules.module
    return {
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": (torch.are_deterministic_algorithms_enabled(),
                                     torch.is_deterministic_algorithms_warn_only_enabled(),
                                     torch.utils.deterministic.fill_uninitialized_memory),
        "anomaly mode": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "intra-op threads": torch.get_num_threads(),
        "distributions' validate_args": torch.distributions.Distribution._validate_args,
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "global module hooks": [len(h) for h in (mm._global_forward_pre_hooks, mm._global_forward_hooks,
                                                 mm._global_backward_pre_hooks, mm._global_backward_hooks)],
        "torch function modes": len(ti.current_function_modes()),
        "torch dispatch modes": len(ti.current_dispatch_modes()),
        "current folder": os.getcwd(),
        "signal handlers": [signal.getsignal(s) for s in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM)],
        "a pending alarm": signal.getitimer(signal.ITIMER_REAL)[0] > 0,
        "environment": {k: v for k, v in os.environ.items() if k not in _ENV_IGNORED},
    }


@pytest.fixture(autouse=True)
def _no_state_left_behind():
    """Fails the test that leaves process-wide state changed (and puts the simple parts back for the next)."""
    before = _global_state()
    yield
    after = _global_state()
    changed = [k for k in before if before[k] != after[k]]
    if not changed:
        return
    torch.set_default_dtype(before["default dtype"])
    det, warn, fill = before["deterministic algorithms"]
    torch.use_deterministic_algorithms(det, warn_only=warn)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.autograd.set_detect_anomaly(*before["anomaly mode"])
    torch.set_grad_enabled(before["grad mode"])
    torch.set_num_threads(before["intra-op threads"])
    torch.distributions.Distribution.set_default_validate_args(before["distributions' validate_args"])
    torch.set_float32_matmul_precision(before["float32 matmul precision"])
    os.chdir(before["current folder"])
    env = before["environment"]
    if after["environment"] != env:
        changed.remove("environment")
        diff = sorted(k for k in env.keys() | after["environment"].keys() if env.get(k) != after["environment"].get(k))
        changed.append(f"environment ({', '.join(diff)})")
    pytest.fail(f"the test left process-wide state changed for the tests after it: {'; '.join(changed)}",
                pytrace=False)


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
