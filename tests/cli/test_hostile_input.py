"""`nanreplay analyze` with hostile or damaged input: one escaped line, bounded time and memory, only regular
files written, no planted module imported (issue 14). The format's own field checks are tested in tests/formats."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner
from clirun import one_line_error, run

from nanreplay import atomic
from nanreplay.cli import main

CLEAR_AND_CLIPBOARD = "\x1b[2J\x1b]52;c;ZWNobyBwd25lZA==\x07\x9b1m"
FORGED = "\nnanreplay: analysis OK"


def assert_inert(text: str) -> None:
    """No control character but the newlines between lines, no bidi override: nothing a terminal would act on."""
    bad = [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0 or c in "\u202e\u2066\u2069"]
    assert not bad, bad


# ---------------------------------------------------------------- models whose names carry hostile strings


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.fc(x) * 0)  # log(0) = -inf


class Named(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.child = name
        self.add_module(name, Inner())

    def forward(self, x):
        return getattr(self, self.child)(x).mean()


ESCAPE_NAME = f"enc{CLEAR_AND_CLIPBOARD}"
BIDI_NAME = "user\u202e\u2066admin\u2069\u2066"
LONG_NAME = "m" * 2_000_000


def escape_model():
    torch.manual_seed(0)
    return Named(ESCAPE_NAME)


def bidi_model():
    torch.manual_seed(0)
    return Named(BIDI_NAME)


def long_model():
    torch.manual_seed(0)
    return Named(LONG_NAME)


def raising_factory():
    raise ValueError(f"boom{FORGED}{CLEAR_AND_CLIPBOARD}")


class Sleepy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(60)
        return self.fc(x).mean()


def sleepy():
    return Sleepy()


def _snapshot(path: Path, factory) -> Path:
    torch.save({"x": torch.randn(3, 4), "state": factory().state_dict()}, path)
    return path


@pytest.fixture
def snap(tmp_path):
    return _snapshot(tmp_path / "s.pt", escape_model)


# ---------------------------------------------------------------- terminal injection


def test_module_names_reach_the_terminal_escaped(tmp_path, snap):
    res = run("analyze", snap, "--model", f"{__name__}:escape_model", "-o", tmp_path / "r.html", "--no-verify")
    assert res.exit_code == 0, res.output
    assert_inert(res.output)
    assert "enc\\x1b[2J\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\x9b1m" in res.stdout  # shown, but escaped
    assert sum(ln.startswith("nanreplay:") for ln in res.output.splitlines()) == 1


def test_a_snapshot_path_with_a_newline_cannot_forge_a_line(tmp_path):
    p = _snapshot(tmp_path / f"x{FORGED}{CLEAR_AND_CLIPBOARD}.pt", escape_model)
    res = run("analyze", p, "--model", f"{__name__}:escape_model", "-o", tmp_path / "r.html", "--no-verify")
    assert res.exit_code == 0, res.output
    assert_inert(res.output)
    assert not any(ln.startswith("nanreplay: analysis OK") for ln in res.output.splitlines())
    bad = tmp_path / f"y{FORGED}.pt"
    bad.write_bytes(b"PK\x03\x04 not really")
    err = one_line_error(run("analyze", bad, "--model", f"{__name__}:escape_model"), 2)
    assert "\\nnanreplay: analysis OK" in err


def test_an_error_message_with_newlines_and_escapes_is_one_inert_line(snap):
    err = one_line_error(run("analyze", snap, "--model", f"{__name__}:raising_factory"), 2, "factory raised ValueError")
    assert_inert(err)
    assert err.startswith("nanreplay: error: ") and "boom\\nnanreplay: analysis OK\\x1b[2J" in err


def test_bidi_overrides_are_visible_in_the_report(tmp_path):
    p = _snapshot(tmp_path / "s.pt", bidi_model)
    out = tmp_path / "r.html"
    res = run("analyze", p, "--model", f"{__name__}:bidi_model", "-o", out, "--no-verify")
    assert res.exit_code == 0, res.output
    html = out.read_text()
    assert "[U+202E]" in html and not any(c in html for c in "\u202e\u2066\u2069")
    assert_inert(res.output)


def test_a_2mb_string_does_not_make_a_huge_report(tmp_path):
    p = _snapshot(tmp_path / "s.pt", long_model)
    out = tmp_path / "r.html"
    res = run("analyze", p, "--model", f"{__name__}:long_model", "-o", out, "--no-verify")
    assert res.exit_code == 0, res.output
    assert out.stat().st_size < 1_000_000, out.stat().st_size
    assert "…" in out.read_text()
    assert max(len(ln) for ln in res.output.splitlines()) <= 1000


# ---------------------------------------------------------------- output paths


def test_output_onto_a_symlink_is_refused_and_its_target_kept(tmp_path, snap):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "link.html"
    link.symlink_to(victim)
    for opt in ("-o", "--json"):
        one_line_error(run("analyze", snap, "--model", f"{__name__}:escape_model", opt, link), 2,
                       "symbolic link", "regular files")
    assert link.is_symlink() and victim.read_text() == "precious"


def test_output_onto_a_fifo_is_refused_without_blocking(tmp_path, snap):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    for opt in ("-o", "--json"):
        one_line_error(run("analyze", snap, "--model", f"{__name__}:escape_model", opt, fifo), 2, "FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_the_null_device_is_never_replaced(snap, monkeypatch):
    real_replace, real_link = os.replace, os.link

    def guarded(real):
        def call(src, dst, *a, **k):
            assert not str(dst).startswith("/dev/"), f"about to replace {dst}"
            return real(src, dst, *a, **k)
        return call

    # Even if the refusal were broken, this test must not replace /dev/null on the machine that runs it.
    monkeypatch.setattr(atomic.os, "replace", guarded(real_replace))
    monkeypatch.setattr(atomic.os, "link", guarded(real_link))
    before = os.lstat(os.devnull)
    for opt in ("-o", "--json"):
        one_line_error(run("analyze", snap, "--model", f"{__name__}:escape_model", opt, os.devnull), 2,
                       "character device")
    after = os.lstat(os.devnull)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_dash_and_dev_stdout_mean_stdout(tmp_path, snap):
    res = run("analyze", snap, "--model", f"{__name__}:escape_model", "-o", "-", "--no-verify")
    assert res.exit_code == 0, res.output
    assert res.stdout.lstrip().startswith("<!DOCTYPE html>") and "(stdout)" in res.stderr
    res = run("analyze", snap, "--model", f"{__name__}:escape_model", "-o", tmp_path / "r.html", "--json",
              "/dev/stdout", "--no-verify")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["verdict"] == "culprit_found"
    assert (tmp_path / "r.html").is_file() and Path("/dev/stdout").is_symlink()


def test_two_outputs_on_one_destination_are_refused(tmp_path, snap):
    one_line_error(run("analyze", snap, "--model", f"{__name__}:escape_model", "-o", "-", "--json", "-"), 2,
                   "both write to stdout")
    same = tmp_path / "out.html"
    one_line_error(run("analyze", snap, "--model", f"{__name__}:escape_model", "-o", same, "--json", same), 2,
                   "same file")
    one_line_error(run("analyze", snap, "--model", f"{__name__}:escape_model", "-o", tmp_path), 2, "is a directory")
    assert not same.exists()


# ---------------------------------------------------------------- devices, time, memory


@pytest.mark.parametrize("device,needle", [("meta", "meta tensors hold no values"), ("mps", "not available"),
                                           ("cuda:99", "cuda"), ("xla", "not available"), ("warp9", "--device")])
def test_a_device_this_machine_lacks_is_one_line(snap, device, needle):
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has mps")
    one_line_error(run("analyze", snap, "--model", f"{__name__}:escape_model", "--device", device), 2, needle)


def test_triage_refuses_a_device_this_machine_lacks(snap, tmp_path):
    res = CliRunner().invoke(main, ["triage", str(snap.parent), "-o", str(tmp_path / "out"), "--device", "meta"])
    one_line_error(res, 2, "meta")
    assert not (tmp_path / "out").exists()


def test_analyze_timeout_stops_a_hung_replay(tmp_path):
    p = _snapshot(tmp_path / "s.pt", sleepy)
    out = tmp_path / "r.html"
    t0 = time.monotonic()
    err = one_line_error(run("analyze", p, "--model", f"{__name__}:sleepy", "--timeout", "1", "-o", out), 1,
                         "no result after 1 s", "--timeout")
    assert time.monotonic() - t0 < 20 and str(p) in err
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))


def test_max_memory_refuses_a_snapshot_too_big_for_it(snap, tmp_path):
    one_line_error(run("analyze", snap, "--model", f"{__name__}:escape_model", "--max-memory", "1K",
                       "-o", tmp_path / "r.html"), 2, "--max-memory", "1 KiB")
    assert not (tmp_path / "r.html").exists()
    res = run("analyze", snap, "--model", f"{__name__}:escape_model", "--max-memory", "lots")
    assert res.exit_code == 2 and "--max-memory" in res.stderr and "Traceback" not in res.output


def test_max_memory_reaches_a_rebuild_that_accepts_it(snap, monkeypatch):
    from nanreplay import formats
    from nanreplay.analysis import analyze

    seen = {}
    real = formats.rebuild

    def rebuild(snap, *, max_memory=None, **kw):
        seen["max_memory"] = max_memory
        return real(snap, **kw)

    monkeypatch.setattr(formats, "rebuild", rebuild)
    analyze(snap, model=f"{__name__}:escape_model", verify=False, max_memory=3 << 30)
    assert seen == {"max_memory": 3 << 30}
    monkeypatch.setattr(formats, "rebuild", real)  # one that does not take it: not passed, no TypeError
    assert analyze(snap, model=f"{__name__}:escape_model", verify=False, max_memory=3 << 30).verdict == "culprit_found"


# ---------------------------------------------------------------- sys.path: no planted module shadows a package

PLANTED = """
import pathlib
pathlib.Path(__file__).with_name("PLANTED_MODULE_RAN").write_text("pwned")
raise ImportError("planted")
"""

USER_MODEL = """
import torch, torch.nn as nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.fc(x) * 0).mean()


def build():
    torch.manual_seed(0)
    return M()
"""


@pytest.mark.parametrize("how", ["python -m", "console script"])
def test_a_planted_jinja2_next_to_the_snapshot_never_runs(tmp_path, how):
    (tmp_path / "jinja2.py").write_text(PLANTED)
    (tmp_path / "markupsafe.py").write_text(PLANTED)
    (tmp_path / "usermodel.py").write_text(textwrap.dedent(USER_MODEL))
    code = "import sys; sys.path.insert(0, '.'); import usermodel, torch; " \
           "torch.save({'x': torch.randn(3, 4), 'state': usermodel.build().state_dict()}, 's.pt')"
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=120)
    script = Path(sys.executable).with_name("nanreplay")
    if how == "console script" and not script.exists():
        pytest.skip("no nanreplay console script next to this interpreter")
    cmd = [sys.executable, "-m", "nanreplay.cli"] if how == "python -m" else [str(script)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([*cmd, "analyze", "s.pt", "--model", "usermodel:build", "-o", "r.html", "--no-verify"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp_path / "PLANTED_MODULE_RAN").exists()
    assert "LogBackward0" in (tmp_path / "r.html").read_text() or "log" in (tmp_path / "r.html").read_text()


def test_the_docs_list_the_limits_and_their_flags():
    from samples import ROOT

    doc = (ROOT / "docs" / "analyze.md").read_text()
    para = doc.split("Bad input — ", 1)[1].split("\n## ", 1)[0]
    for needle in ("exit\ncode 2", "exit code 1", "--max-memory SIZE", "--timeout SECONDS", "/dev/null", "symlink",
                   "FIFO", "zip bomb", "SIGBUS", "jinja2.py", "[U+202E]", "ellipsis"):
        assert needle in para, needle
    for cmd in ("analyze", "triage"):
        help_text = CliRunner().invoke(main, [cmd, "--help"]).output
        assert "--max-memory" in help_text and "--timeout" in help_text
