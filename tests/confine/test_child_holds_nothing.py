"""A child that holds nothing of yours: a triage-style fork child sees none of the analyst's environment (not even
in /proc/self/environ), and the seccomp filter denies what would let a compromised child outlive nanreplay,
reach other processes, keyrings or System V IPC. A subprocess (started with a secret in its environment) runs a
fork child whose fake analysis reports what it could do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanreplay.confine import filters

ROOT = Path(__file__).resolve().parents[2]
SECRET = "analysts-secret-4242"

_DRIVER = r'''
import ctypes, json, os, resource, sys
from nanreplay import confine
from nanreplay.confine import child

def attempts():
    out = {"environ": open("/proc/self/environ", "rb").read().decode("latin-1")}
    for name, fn in [("setsid", os.setsid),
                     ("prlimit of another process", lambda: resource.prlimit(1, resource.RLIMIT_NOFILE)),
                     ("prlimit of itself", lambda: resource.prlimit(0, resource.RLIMIT_NOFILE)),
                     ("setpriority of another process", lambda: os.setpriority(os.PRIO_PROCESS, 1, 5)),
                     ("setpriority of itself", lambda: os.setpriority(os.PRIO_PROCESS, 0, 1))]:
        try:
            fn()
            out[name] = "allowed"
        except OSError as e:
            out[name] = f"denied: {e.strerror}"
    libc = ctypes.CDLL(None, use_errno=True)
    for name, nr in [("keyctl", 250), ("shmget", 29), ("bpf", 321), ("userfaultfd", 323), ("unshare", 272)]:
        r = libc.syscall(nr, 0, 0, 0, 0, 0)  # (x86_64 numbers; the test runs there)
        out[name] = "allowed" if r >= 0 else f"denied: {os.strerror(ctypes.get_errno())}"
    return out

def fake(job):
    state = child.confine_self(job)
    return {"schema": "probe", "snapshot": job["path"], "verdict": "probe", "diagnosis": {}, "stats": {},
            "environment": {"confinement": state}, "attempts": attempts()}

child._analyze = fake
snap = sys.argv[1]
d = confine.run({"path": snap, "shown": "snap.pt", "max_memory": 1 << 30}, fork=True)
print(json.dumps(d))
'''


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the driver names x86_64 syscall numbers")
def test_a_fork_child_holds_no_environment_and_the_filter_denies_the_escapes(tmp_path):
    snap = tmp_path / "snap.pt"
    snap.write_bytes(b"a snapshot")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "AWS_SECRET_ACCESS_KEY": SECRET}
    res = subprocess.run([sys.executable, "-c", _DRIVER, str(snap)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(res.stdout.strip().splitlines()[-1])
    got = d["attempts"]
    assert SECRET not in got["environ"] and "AWS_SECRET" not in got["environ"], got["environ"]
    for name in ("setsid", "prlimit of another process", "setpriority of another process", "keyctl", "shmget", "bpf",
                 "userfaultfd", "unshare"):
        assert got[name].startswith("denied"), (name, got[name])
    assert got["prlimit of itself"] == "allowed" and got["setpriority of itself"] == "allowed"
    c = d["environment"]["confinement"]
    assert c["seccomp"] is True
    if os.geteuid() == 0:  # run as root: every capability dropped before the snapshot is opened
        assert c.get("capabilities") == "dropped" and "capabilities" not in (c["lost"] or "")


def test_the_filter_lists_what_it_denies():
    denied = filters.denied_syscalls()
    if os.uname().machine in ("x86_64", "aarch64"):
        assert {"setsid", "bpf", "keyctl", "shmat", "userfaultfd", "unshare"} <= set(denied)
        assert "prlimit64 (other processes)" in denied
