"""`nanreplay analyze DIR --nproc N`: N local ranks with torch's own elastic launcher, one merged analysis.

    python -m torch.distributed.run --standalone --nproc-per-node N -m nanreplay.analysis.rankworker DIR --out TMP

(gloo on the CPU, NCCL with `--device cuda`). The ranks write the merged analysis as JSON into a private
temporary folder (also their working folder); this process reads it back and removes the folder. A rank's own error (a damaged
snapshot, a limit) comes back as the same one-line error; anything else as a ReplayError with the last
lines the launcher printed. The launcher runs in its own process group: on --timeout or Ctrl-C the whole
group (launcher and ranks) is stopped, never left behind (interrupt.cleanup). Scale beyond one host: docs/sharded.md.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from nanreplay import errors, interrupt
from nanreplay.errors import ReplayError, first_line


def run_nproc(folder: str, nproc: int, *, device: str | None, max_memory: int | None,
              source: list[str] | None) -> dict:
    """The merged analysis JSON of `folder`, replayed on `nproc` local ranks."""
    out = tempfile.mkdtemp(prefix="nanreplay-ranks-")
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=0", "-m", "nanreplay.analysis.rankworker", os.path.abspath(folder), "--out", out]
        if device:
            cmd += ["--device", device]
        if max_memory is not None:
            cmd += ["--max-memory", str(max_memory)]
        for s in source or [os.getcwd()]:
            cmd += ["--source", os.path.abspath(s)]
        cmd += ["--cwd", os.getcwd()]
        rc, log = _run(cmd, out)
        result = Path(out, "analysis.json")
        for err in sorted(Path(out).glob("rank*.error.json")):
            d = json.loads(err.read_text())
            cls = getattr(errors, str(d.get("type")), None)
            if not (isinstance(cls, type) and issubclass(cls, errors.NanReplayError)):
                cls = ReplayError
            raise cls(str(d.get("message")))
        if rc != 0 or not result.is_file():
            tail = " | ".join(ln for ln in log.splitlines()[-6:] if ln.strip())
            raise ReplayError(f"{folder}: the {nproc}-rank analysis failed (torch.distributed.run exit code {rc}): "
                              f"{first_line(tail, 600)}")
        return json.loads(result.read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _run(cmd: list[str], cwd: str) -> tuple[int, str]:
    # cwd: `python -m` puts the working folder first on sys.path; ours is the private temp folder, so no file
    # where the user happens to stand can shadow a module in the ranks
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
    # the command's Ctrl-C and --timeout end it without unwinding (interrupt.py): this cleanup stops the group then
    with interrupt.cleanup(lambda: (_stop(proc), shutil.rmtree(cwd, ignore_errors=True))):
        try:
            log, _ = proc.communicate()
        except BaseException:  # Ctrl-C in a library caller: stop the launcher and every rank it started
            _stop(proc)
            raise
    return proc.returncode, log.decode("utf-8", "replace")


def _stop(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue
