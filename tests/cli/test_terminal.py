"""What `nanreplay analyze` shows on a terminal and on a pipe: a status line from the first second (a TTY only),
the node counter read from the confined child's progress page, the coloured verdict (NO_COLOR honoured), -q,
--no-report.

The TTY cases run the real command under a pseudo-terminal (python's pty module), from a folder of their own.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys

from clirun import one_line_error, run

from samples import ROOT

SAMPLE = str(ROOT / "sample_snapshots" / "sqrt_zero.pt")
RED = "\x1b[1;31m"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    env.update(PYTHONPATH=str(ROOT), TERM="xterm", **extra)
    return env


def _on_a_tty(args: list[str], cwd, **env: str) -> tuple[int, str]:
    """Run `python -m nanreplay.cli ARGS` with stdin/stdout/stderr on a pseudo-terminal; (exit code, all it wrote)."""
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.chdir(cwd)
        os.execve(sys.executable, [sys.executable, "-m", "nanreplay.cli", *args], _env(**env))
    out = b""
    try:
        while True:
            if not select.select([fd], [], [], 300)[0]:
                os.kill(pid, 9)
                break
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(fd)  # the terminal's master side: one descriptor per call otherwise (under `ulimit -n`, they add up)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), out.decode("utf-8", "replace")


def test_a_terminal_gets_a_status_line_at_once_and_a_coloured_verdict(tmp_path):
    code, out = _on_a_tty(["analyze", SAMPLE, "--no-report"], tmp_path)
    assert code == 0, out
    assert out.startswith("\r\x1b[Knanreplay: starting...")  # the first thing written, before torch is imported
    assert "culprit found" in out and f"sqrt_zero.pt: {RED}culprit found\x1b[0m" in out
    assert "fix      [verified by replay]" in out and out.rstrip().endswith("(a later node than the culprit)")
    assert list(tmp_path.iterdir()) == []  # --no-report: nothing written in the current folder


def test_an_analysis_in_this_process_talks_too(tmp_path):
    """--model runs the analysis in the command's own process: the same status line (from a thread reading the
    same progress page) and the coloured verdict."""
    plain = str(ROOT / "sample_snapshots" / "nan_snapshot_step_3.pt")
    code, out = _on_a_tty(["analyze", plain, "--model", "sample_snapshots.models:triplet", "--no-report"], tmp_path)
    assert code == 0, out
    assert out.startswith("\r\x1b[Knanreplay: starting...") and "\r\x1b[Knanreplay: replaying the step..." in out
    assert f"nan_snapshot_step_3.pt: {RED}culprit found\x1b[0m" in out and "Traceback" not in out


def test_no_color_and_quiet_on_a_terminal(tmp_path):
    code, out = _on_a_tty(["analyze", SAMPLE, "--no-report"], tmp_path, NO_COLOR="1")
    assert code == 0 and "culprit found" in out and "\x1b[1;" not in out
    code, out = _on_a_tty(["analyze", SAMPLE, "-q", "-o", str(tmp_path / "r.html")], tmp_path)
    assert code == 0 and out == "" and (tmp_path / "r.html").exists()


def test_a_pipe_gets_no_status_line_and_no_colour(tmp_path):
    res = subprocess.run([sys.executable, "-m", "nanreplay.cli", "analyze", SAMPLE, "--no-report"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=_env())
    assert res.returncode == 0, res.stderr
    assert "culprit found" in res.stdout and "\x1b" not in res.stdout + res.stderr and "\r" not in res.stdout
    assert "report   " not in res.stdout and list(tmp_path.iterdir()) == []


def test_the_status_line_counts_the_childs_nodes():
    """The parent's ticker reads the page the child writes before each node (confine/progress.py)."""
    import io

    from nanreplay import cli
    from nanreplay.confine import progress

    fd = os.memfd_create("progress-test")
    try:
        os.ftruncate(fd, progress.SIZE)
        assert progress.status(fd) is None
        progress.attach(fd)
        progress.at(progress.DRY_RUN, 6, "aten.mm.default", 40)
        assert progress.status(fd) == (progress.DRY_RUN, 6, 40)

        class Tty(io.StringIO):
            def isatty(self):
                return True

        live = cli._Live(err=True)
        live.stream = Tty()
        live.tty = True
        live.tick(progress.status(fd))
        progress.at(progress.REPLAY, 9, "aten.mm.default", 40)
        live.tick(progress.status(fd))
        live._stage = "diagnosing and verifying the fix"
        live.tick(progress.status(fd))
        shown = live.stream.getvalue()
        assert "nanreplay: checking the step program (dry run, node 7/40)..." in shown
        assert "nanreplay: replaying the step (node 10/40)..." in shown
        assert "nanreplay: diagnosing and verifying the fix (node 10/40)..." in shown
        assert progress.read(fd) == ("the replay", 9, "aten.mm.default")  # the crash line's reading is unchanged
    finally:
        progress._page = None
        os.close(fd)


def test_no_report_with_o_is_one_line(tmp_path):
    res = run("analyze", SAMPLE, "--no-report", "-o", tmp_path / "r.html", cwd=tmp_path)
    one_line_error(res, 2, "-o and --no-report together")
    assert list(tmp_path.iterdir()) == []


def test_quiet_prints_only_what_stdout_was_asked_for(tmp_path):  # (-q: on a terminal, above)
    res = run("analyze", SAMPLE, "--quiet", "--no-report", "--json", "-", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    assert res.stdout.lstrip().startswith("{") and res.stderr == ""
