"""A test-only confined child: the real child's confinement (child.confine_self), then what a hostile kernel
might try — read the analyst's files, create one, open sockets, signal its parent, crash — reported back.
Run by tests/confine/test_confine.py through `confine.run(job, entry=<this file>)`; not part of the package."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from nanreplay.confine import child, progress


def attempts(job: dict) -> dict:
    out = {}
    for name, path in job["reads"].items():
        try:
            with open(path, "rb") as f:
                f.read(1)
            out[name] = "read"
        except OSError as e:
            out[name] = f"denied: {e.strerror}"
    try:
        open(os.path.join(job["writable"], "created"), "w").close()
        out["create"] = "created"
    except OSError as e:
        out["create"] = f"denied: {e.strerror}"
    for fam in ("AF_INET", "AF_INET6", "AF_UNIX"):
        try:
            s = socket.socket(getattr(socket, fam))
            s.settimeout(2)
            s.connect(("127.0.0.1", job["port"]) if fam == "AF_INET" else
                      ("::1", job["port"]) if fam == "AF_INET6" else "\0nanreplay-test")
            out[fam] = "connected"
        except OSError as e:
            out[fam] = f"denied: {e.strerror or e}"
    return out


def compile_in(scratch: str) -> str:
    """Write a C file in the scratch folder, build it into a shared library with the C compiler, load it, call it."""
    import ctypes
    import subprocess

    src = os.path.join(scratch, "k.c")
    try:
        with open(src, "w") as f:
            f.write("int twice(int x) { return 2 * x; }\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-o", os.path.join(scratch, "k.so"), src], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return f"compiled and ran: {ctypes.CDLL(os.path.join(scratch, 'k.so')).twice(21)}"
    except (OSError, subprocess.CalledProcessError) as e:
        return f"failed: {e} {getattr(e, 'stderr', b'')[-300:]!r}"


def _fds() -> dict:
    out = {}
    for f in os.listdir("/proc/self/fd"):
        try:
            out[f] = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            pass  # the listing's own descriptor, closed already
    return out


def fake_analyze(job: dict) -> dict:
    state = child.confine_self(job)
    if job["probe"] == "segv":
        progress.at(progress.REPLAY, 7, "aten.embedding_dense_backward.default")
        os.kill(os.getpid(), signal.SIGSEGV)
    if job["probe"] == "memory":
        return {"block": len(bytearray(8 << 30))}  # far past --max-memory and the headroom
    if job["probe"] == "compile":  # the compile child (differential/compiler.py): what inductor does, in miniature
        return {"schema": "probe", "snapshot": job["path"], "verdict": "probe", "diagnosis": {}, "stats": {},
                "environment": {"confinement": state, "env": dict(os.environ)},
                "attempts": {**attempts(job), "scratch": compile_in(job["scratch"])}}
    return {"schema": "probe", "snapshot": job["path"], "verdict": "probe", "diagnosis": {}, "stats": {},
            "environment": {"confinement": state, "cwd": os.getcwd(), "env": sorted(os.environ),
                            "fds": _fds()},
            "attempts": attempts(job)}


if __name__ == "__main__":
    child._analyze = fake_analyze
    child.main(json.loads(sys.argv[1]))
