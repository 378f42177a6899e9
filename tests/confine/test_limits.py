"""Limits that clamp, not crash: the analysis under a `ulimit -v` lower than its own address-space limit, and a
SIGTERM that leaves no temporary folder behind."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanreplay.limits import format_size

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_snapshots" / "sqrt_zero.pt"
NANREPLAY = [sys.executable, "-c", "from nanreplay.cli import main; main()"]


def _inherited_cap() -> int | None:
    """The address-space limit these tests already run under (`ulimit -v`), if any."""
    limits = [v for v in resource.getrlimit(resource.RLIMIT_AS) if v != resource.RLIM_INFINITY]
    return min(limits) if limits else None


# below what the child asks for with --max-memory 8G (what torch maps + 8 GiB + 1 GiB + threads); under a lower
# `ulimit -v` that one (only root may raise a hard limit: setting 6 GiB over a 5.7 GiB one raised in preexec_fn)
CAP = min(6 << 30, _inherited_cap() or 6 << 30)


def _env(tmp: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}


def _cap_address_space() -> None:  # what `ulimit -v` does: soft and hard
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


def test_an_analysis_under_ulimit_v_clamps_its_limit_and_says_so(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "r.json"
    res = subprocess.run([*NANREPLAY, "analyze", str(SAMPLE), "--no-verify", "--max-memory",
                          "8G", "--json", str(out), "-o", str(tmp_path / "r.html")], env=_env(tmp), cwd=tmp_path,
                         preexec_fn=_cap_address_space, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    c = json.loads(out.read_text())["environment"]["confinement"]
    assert c["rlimits"]["as"] == CAP
    assert "RLIMIT_AS" in c["lost"] and str(CAP) in c["lost"]
    assert list(tmp.iterdir()) == []  # its temporary folder is gone


def test_sigterm_removes_the_temporary_folder_and_the_child(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([*NANREPLAY, "analyze", str(SAMPLE), "--json", str(tmp_path / "r.json"),
                             "-o", str(tmp_path / "r.html")], env=_env(tmp), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp.glob("nanreplay-confined-*")):
        assert proc.poll() is None and time.monotonic() < deadline, "the child's folder never appeared"
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "nanreplay: terminated"
    assert list(tmp.iterdir()) == []
    assert not (tmp_path / "r.json").exists()


if not sys.platform.startswith("linux"):  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="confinement is Linux-only")


def test_sigterm_during_triage_leaves_no_temporary_folder(tmp_path):
    """Triage's workers are killed on SIGTERM and cannot clean up: their children's folders live in one folder of
    the parent's, which it removes."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    for name in "abcdefgh":  # enough work that a loaded machine still sees a child's folder before triage ends
        (snaps / f"{name}.pt").write_bytes(SAMPLE.read_bytes())
    proc = subprocess.Popen([*NANREPLAY, "triage", str(snaps), "-o", str(tmp_path / "out"), "--no-cache"],
                            env=_env(tmp), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(tmp.glob("nanreplay-triage-*/nanreplay-confined-*")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"no confined child's folder appeared (exit {proc.returncode}): {out[-800:]} {err[-1500:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    end = time.monotonic() + 10  # (a killed worker's child dies with it: nothing recreates a folder)
    while [p for p in tmp.iterdir() if p.name.startswith("nanreplay-")] and time.monotonic() < end:
        time.sleep(0.1)
    assert [p.name for p in tmp.iterdir() if p.name.startswith("nanreplay-")] == []


def test_out_of_memory_under_ulimit_v_names_that_limit_not_max_memory():
    """Under a `ulimit -v` far below --max-memory (a cluster node), an analysis that ran out of memory said "under
    --max-memory 13 GiB": the limit that stopped it was the inherited one, and only raising that helps."""
    code = ("import resource; from nanreplay import confine; "
            "print(confine._memory_cap(8 << 30)); "
            f"resource.setrlimit(resource.RLIMIT_AS, ({CAP}, {CAP})); print(confine._memory_cap(8 << 30))")
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    free, capped = res.stdout.strip().splitlines()
    if (_inherited_cap() or 8 << 30) >= 8 << 30:  # (under a lower `ulimit -v` the first is capped too)
        assert free.startswith("--max-memory 8 GiB") and "ulimit" not in free
    assert "ulimit -v" in capped and f"({format_size(CAP)}:" in capped and "below --max-memory 8 GiB" in capped
