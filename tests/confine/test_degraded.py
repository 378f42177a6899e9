"""A degraded sandbox says so on the terminal, not only in the JSON (round 5, docs/trust.md). The command runs
under a seccomp filter of the test's own that makes `landlock_create_ruleset` fail with ENOSYS (a kernel without
Landlock) and, for `analyze`, `prctl(PR_SET_SECCOMP)` fail with EINVAL (a container that refuses a filter): the
analysis still runs confined as far as it can, exit 0, and one warning line names what was lost. Before, only
`environment.confinement.lost` in the JSON said it, and an analyst reading the terminal or the report could not
know that the snapshot's files had not been filtered."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_snapshots" / "sqrt_zero.pt"
NANREPLAY = [sys.executable, "-c", "from nanreplay.cli import main; main()"]

if not sys.platform.startswith("linux") or platform.machine() != "x86_64":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="the test's filter is written for x86_64 Linux")


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def _deny(*, seccomp: bool):
    """A preexec_fn: this process and what it starts see no Landlock (and, with `seccomp`, cannot add a filter)."""
    LD, JEQ, RET = 0x20, 0x15, 0x06
    enosys, einval, allow = 0x00050000 | 38, 0x00050000 | 22, 0x7FFF0000
    prog = [_bpf(LD, 0), _bpf(JEQ, 444, 0, 1), _bpf(RET, enosys)]  # landlock_create_ruleset
    if seccomp:  # seccomp(2), and prctl(PR_SET_SECCOMP, ...)
        prog += [_bpf(JEQ, 317, 0, 1), _bpf(RET, einval), _bpf(JEQ, 157, 0, 3), _bpf(LD, 16), _bpf(JEQ, 22, 0, 1),
                 _bpf(RET, einval)]
    prog.append(_bpf(RET, allow))

    def install() -> None:
        code = b"".join(prog)
        buf = ctypes.create_string_buffer(code, len(code))
        fprog = struct.pack("<HxxxxxxQ", len(prog), ctypes.addressof(buf))
        fbuf = ctypes.create_string_buffer(fprog, len(fprog))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.addressof(fbuf), 0, 0):
            os._exit(99)
    return install


def _run(args: list[str], tmp: Path, *, seccomp: bool) -> subprocess.CompletedProcess:
    return subprocess.run([*NANREPLAY, *args], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp,
                          preexec_fn=_deny(seccomp=seccomp), capture_output=True, text=True, timeout=600)


def test_analyze_without_landlock_or_seccomp_says_so_on_the_terminal(tmp_path):
    res = _run(["analyze", str(SAMPLE), "--no-verify", "-q", "--json", "r.json", "-o", "r.html"], tmp_path,
               seccomp=True)
    assert res.returncode == 0, res.stderr[-2000:]
    c = json.loads((tmp_path / "r.json").read_text())["environment"]["confinement"]
    assert c["landlock"] is None and c["seccomp"] is False, c
    lines = [ln for ln in res.stderr.splitlines() if "warning" in ln]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith("nanreplay: warning: the analysis ran less confined than usual: ")
    assert "no Landlock" in lines[0] and "seccomp failed" in lines[0]


def test_triage_without_landlock_says_so_once(tmp_path):
    folder = tmp_path / "snaps"
    folder.mkdir()
    for name in ("a.pt", "b.pt"):
        shutil.copy(SAMPLE, folder / name)
    res = _run(["triage", str(folder), "-o", str(tmp_path / "out"), "--jobs", "1", "--no-verify"], tmp_path,
               seccomp=False)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if "warning" in ln]
    assert lines == ["nanreplay: warning: no Landlock on this kernel: the snapshots' analyses run confined without "
                     "a file filter (only the limits, seccomp and an empty private folder hold)"], res.stderr
    row = json.loads((tmp_path / "out" / "a.json").read_text())
    assert "no Landlock" in row["environment"]["confinement"]["lost"]
