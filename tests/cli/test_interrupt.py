"""Ctrl-C and --timeout on the real command, in a subprocess: one line, the exit code, the outputs as they were.

SIGINT is delivered at named moments by a small driver that runs `python -m nanreplay.cli` with one hook
installed: while torch imports numpy, during the replay, while the report renders, while triage's workers
run, and in the middle of triage writing its index. Each moment is where an interrupt used to go wrong
(ignored, blamed on the snapshot as a RecursionError, click's bare "Aborted!", a half-updated index).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from samples import ROOT, SAMPLES

DRIVER = r"""
import os, signal, sys, threading, time
moment, args = sys.argv[1], sys.argv[2:]

def interrupt(after=0.0):
    if after:
        threading.Timer(after, os.kill, (os.getpid(), signal.SIGINT)).start()
    else:
        os.kill(os.getpid(), signal.SIGINT)

def wrap(module, name, after=0.0):
    import importlib
    mod = importlib.import_module(module)
    orig = getattr(mod, name)
    def hooked(*a, **k):
        interrupt(after)
        return orig(*a, **k)
    setattr(mod, name, hooked)

if moment in ("import", "slow_import"):
    # the interrupt (or the deadline) lands inside an import: the command's parent imports no torch (the confined
    # child does), but it imports jinja2 and markupsafe to render; with --no-confine, torch's import of numpy
    class Numpy:
        def find_spec(self, name, path=None, target=None):
            if name in ("numpy", "markupsafe"):
                sys.meta_path.remove(self)
                if moment == "import":
                    interrupt()
                else:
                    time.sleep(8)
            return None
    sys.meta_path.insert(0, Numpy())
elif moment == "replay":  # the confined child is replaying: the parent waits on its pipe
    wrap("nanreplay.confine", "_spawn", after=1.0)
elif moment == "render":
    wrap("nanreplay.report", "render_html")
elif moment == "triage_running":
    wrap("nanreplay.triage.parallel", "_collect", after=1.0)
elif moment == "triage_writing":
    wrap("nanreplay.triage.output", "_remove_stale_outputs")
sys.argv = ["nanreplay", *args]
import runpy
runpy.run_module("nanreplay.cli", run_name="__main__")
"""

OLD = "<!-- the previous output -->"


def _run(tmp_path: Path, moment: str, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", DRIVER, moment, *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=timeout)
    return res, time.monotonic() - t0


def _outputs(tmp_path: Path) -> dict[str, Path]:
    outs = {"report": tmp_path / "r.html", "json": tmp_path / "a.json", "md": tmp_path / "s.md"}
    for p in outs.values():
        p.write_text(OLD)
    return outs


def _interrupted(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 130, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanreplay: interrupted"), res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "Aborted" not in res.stderr
    # stdout holds at most the culprit block, printed as soon as the replay had it, never the finished summary
    assert "  report " not in res.stdout and "  fix " not in res.stdout, res.stdout
    return lines[0]


def _as_they_were(folder: Path, outs) -> None:
    for p in outs:
        assert p.read_text() == OLD, p
    assert not list(folder.glob(".*.tmp")), list(folder.glob(".*"))  # no write's temp file left behind


@pytest.mark.parametrize("moment", ["import", "replay", "render"])
def test_an_interrupt_during_analyze_is_one_line_and_exit_130(tmp_path, moment):
    outs = _outputs(tmp_path)
    res, _ = _run(tmp_path, moment, "analyze", str(SAMPLES / "sqrt_zero.pt"), "-o", str(outs["report"]),
                  "--json", str(outs["json"]), "--markdown", str(outs["md"]))
    assert _interrupted(res) == "nanreplay: interrupted"
    _as_they_were(tmp_path, outs.values())


def test_an_interrupt_at_real_moments_is_clean_whatever_it_hits(tmp_path):
    """The installed command, SIGINT after a delay: either it had finished, or one line, 130, nothing touched.
    (The delays start after the interpreter's own start-up, before any nanreplay code runs, where Python's
    default handler is still in place: about 0.1 s, more on a loaded machine.)"""
    exe = Path(sys.executable).with_name("nanreplay")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "nanreplay.cli"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for delay in (1.0, 3.0):
        outs = _outputs(tmp_path)
        proc = subprocess.Popen([*cmd, "analyze", str(SAMPLES / "zero_log_zero.pt"), "-o", str(outs["report"]),
                                 "--json", str(outs["json"])], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
        res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if proc.returncode == 0:  # it finished first: complete new outputs
            assert "</html>" in outs["report"].read_text() and outs["json"].read_text().startswith("{")
            continue
        _interrupted(res)
        _as_they_were(tmp_path, [outs["report"], outs["json"]])


def test_the_timeout_counts_from_the_start_imports_included(tmp_path):
    """--timeout 1 while torch's import takes 8 s: it gives up after about 1 s (it used to start after the imports)."""
    outs = _outputs(tmp_path)
    res, took = _run(tmp_path, "slow_import", "analyze", str(SAMPLES / "sqrt_zero.pt"), "-o", str(outs["report"]),
                     "--timeout", "1")
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no result after 1 s" in lines[0] and "counts from the start" in lines[0], lines
    assert took < 7  # not 1 s plus the 8 s import
    _as_they_were(tmp_path, [outs["report"]])


def _triage_folder(tmp_path: Path) -> tuple[Path, Path]:
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    for n in ("log_zero", "sqrt_negative"):
        (snaps / f"{n}.pt").write_bytes((SAMPLES / f"{n}.pt").read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    return snaps, out


def test_an_interrupt_while_triage_runs_keeps_the_previous_index_and_says_what_finished(tmp_path):
    snaps, out = _triage_folder(tmp_path)
    old = [out / "index.html", out / "groups.json", out / "summary.csv"]
    for p in old:
        p.write_text(OLD)
    res, _ = _run(tmp_path, "triage_running", "triage", str(snaps), "-o", str(out), "-j", "1", "--no-verify")
    line = _interrupted(res)
    assert "of 2 snapshots were analyzed" in line and "index.html is as it was" in line, line
    _as_they_were(out, old)
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]


def test_an_interrupt_while_triage_writes_its_index_waits_for_a_complete_one(tmp_path):
    snaps, out = _triage_folder(tmp_path)
    (out / "index.html").write_text(OLD)
    res, _ = _run(tmp_path, "triage_writing", "triage", str(snaps), "-o", str(out), "-j", "1", "--no-verify")
    _interrupted(res)
    index = (out / "index.html").read_text()
    assert index != OLD and index.rstrip().endswith("</html>")  # the new index, whole, with its companions
    assert (out / "groups.json").is_file() and (out / "summary.csv").is_file()
    assert not list(out.glob(".*.tmp"))
