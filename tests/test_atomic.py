"""nanreplay.atomic: the umask is never touched, only regular files are replaced, stale temp files are cleaned."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from nanreplay import atomic


def test_mode_follows_the_umask_without_reading_or_setting_it(tmp_path, monkeypatch):
    def forbidden(*a):
        raise AssertionError("os.umask is process-wide: changing it races with other threads")

    mask = os.umask(0o022)
    os.umask(mask)
    monkeypatch.setattr(os, "umask", forbidden)
    atomic.write_text(tmp_path / "a.txt", "hello")
    assert (tmp_path / "a.txt").read_text() == "hello"
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o666 & ~mask
    atomic.write_with(tmp_path / "b.bin", lambda f: f.write(b"x"), overwrite=False)
    with pytest.raises(FileExistsError):
        atomic.write_with(tmp_path / "b.bin", lambda f: f.write(b"y"), overwrite=False)
    assert (tmp_path / "b.bin").read_bytes() == b"x"
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dir"])
def test_never_replaces_anything_but_a_regular_file(tmp_path, kind):
    target = tmp_path / "target.txt"
    target.write_text("keep")
    dest = tmp_path / "dest"
    if kind == "symlink":
        dest.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(dest)
    else:
        dest.mkdir()
    with pytest.raises(atomic.SpecialFileError) as e:
        atomic.write_text(dest, "new")
    assert "refusing to replace it" in str(e.value)
    assert target.read_text() == "keep" and os.path.lexists(dest)
    assert not dest.is_file() or dest.is_symlink()
    assert not list(tmp_path.glob(".*.tmp"))


def test_clean_stale_temps_removes_only_old_temp_files_of_the_prefix(tmp_path):
    old = time.time() - 2 * atomic.STALE_AFTER
    files = {".nan_step000003_loss_x.pt.1a2b3c4d.tmp": old, ".nan_step000004_loss_y.pt.5e6f7a8b.tmp": time.time(),
             ".other.pt.1a2b3c4d.tmp": old, "nan_step000001_loss.pt": old, ".nan_step000005.pt.aaaa.tmpx": old}
    for name, t in files.items():
        (tmp_path / name).write_text("x")
        os.utime(tmp_path / name, (t, t))
    os.symlink(tmp_path / "nan_step000001_loss.pt", tmp_path / ".nan_step_link.tmp")
    os.utime(tmp_path / ".nan_step_link.tmp", (old, old), follow_symlinks=False)
    removed = atomic.clean_stale_temps(tmp_path, "nan_step")
    assert removed == [".nan_step000003_loss_x.pt.1a2b3c4d.tmp"]
    left = {p.name for p in tmp_path.iterdir()}
    assert left == (set(files) - set(removed)) | {".nan_step_link.tmp"}
    assert atomic.clean_stale_temps(tmp_path / "missing", "nan_step") == []  # never raises


def test_a_failed_write_leaves_nothing(tmp_path):
    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic.write_with(tmp_path / "x", boom)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writers_never_share_a_temp_file(tmp_path):
    errors = []

    def run(i):
        try:
            for _ in range(50):
                atomic.write_text(tmp_path / "same.txt", str(i) * 1000)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors
    text = (tmp_path / "same.txt").read_text()
    assert len(text) == 1000 and len(set(text)) == 1


def test_a_set_of_outputs_is_written_whole_or_not_at_all(tmp_path):
    """A report and its JSON on a disk that fills up while they are written: before, the report was left new
    beside no JSON (or an old one); now neither changes and no temp file stays. The disk's end is a real
    file-size limit in a child (RLIMIT_FSIZE: writes past it fail with EFBIG, as a full disk fails with ENOSPC)."""
    (tmp_path / "report.html").write_text("old report")
    code = f"""
import resource, signal, sys
sys.path.insert(0, {str(atomic.__file__.rsplit('/nanreplay/', 1)[0])!r})
from nanreplay import atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    atomic.write_texts([({str(tmp_path / 'report.html')!r}, "new report"), ({str(tmp_path / 'r.json')!r}, "x" * 10000)])
except OSError as e:
    print(e.filename, e.errno)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [str(tmp_path / "r.json"), "27"], out  # EFBIG, naming the output that failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
    assert (tmp_path / "report.html").read_text() == "old report"
    atomic.write_texts([(tmp_path / "report.html", "new report"), (tmp_path / "r.json", "{}")])
    assert (tmp_path / "report.html").read_text() == "new report" and (tmp_path / "r.json").read_text() == "{}"
    assert not list(tmp_path.glob(".*.tmp"))
