"""Reading a snapshot file: no memory map (no SIGBUS), no zip bomb, nothing over the memory limit, no special files."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import zipfile

import pytest
import torch

from nanreplay.errors import LimitError, SnapshotError
from nanreplay.formats import reading
from nanreplay.formats.reading import read_file


def _never_load(*a, **k):
    raise AssertionError("torch.load must not see this file")


def test_a_snapshot_truncated_while_analyzed_does_not_kill_the_process(tmp_path):
    """With a memory-mapped load, touching a tensor whose pages were cut off raises SIGBUS."""
    p = tmp_path / "s.pt"
    torch.save({"x": torch.randn(512, 1024), "state": {"w": torch.randn(1024, 1024)}}, p)
    code = f"""
import os, torch
from nanreplay.formats.reading import read_file
d = read_file({str(p)!r})
os.truncate({str(p)!r}, 0)  # the file is cut while the analysis still runs
print(float(d["x"].abs().sum() + d["state"]["w"].abs().sum()) > 0)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert res.stdout.strip() == "True"


def test_a_snapshot_truncated_during_the_load_is_one_line(tmp_path, monkeypatch):
    p = tmp_path / "s.pt"
    torch.save({"x": torch.randn(256, 1024)}, p)
    real = torch.load

    def cut_then_load(f, *a, **k):
        os.truncate(f, os.path.getsize(f) // 2)
        return real(f, *a, **k)

    monkeypatch.setattr(torch, "load", cut_then_load)
    with pytest.raises(SnapshotError) as e:
        read_file(p)
    assert "\n" not in str(e.value)


def _zip_bomb(path, declared: int) -> None:
    """A zip whose one deflated entry inflates to `declared` bytes of zeros (written in chunks: no big buffer)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        with z.open("archive/data.pkl", "w", force_zip64=True) as f:
            chunk = bytes(1 << 20)
            for _ in range(declared // len(chunk)):
                f.write(chunk)


def test_a_zip_bomb_is_refused_before_torch_load(tmp_path, monkeypatch):
    p = tmp_path / "bomb.pt"
    _zip_bomb(p, 256 << 20)
    assert p.stat().st_size < 2 << 20
    monkeypatch.setattr(torch, "load", _never_load)
    with pytest.raises(SnapshotError) as e:
        read_file(p, max_memory=64 << 30)
    assert "zip bomb" in str(e.value) and "256 MiB" in str(e.value)


def test_data_over_the_memory_limit_is_refused(tmp_path, monkeypatch):
    p = tmp_path / "s.pt"
    torch.save({"x": torch.zeros(1 << 20)}, p)  # 4 MiB of data
    assert read_file(p, max_memory=64 << 20)["x"].numel() == 1 << 20
    monkeypatch.setattr(torch, "load", _never_load)
    with pytest.raises(LimitError) as e:
        read_file(p, max_memory=1 << 20)
    assert "--max-memory" in str(e.value) and "1 MiB" in str(e.value)


def test_a_huge_sparse_file_is_refused_at_once(tmp_path, monkeypatch):
    p = tmp_path / "huge.pt"
    with open(p, "wb") as f:
        f.write(b"PK\x03\x04")
        f.truncate(20 << 30)  # 20 GiB, sparse: nothing to read but zeros
    monkeypatch.setattr(torch, "load", _never_load)
    t0 = time.monotonic()
    with pytest.raises(LimitError) as e:
        read_file(p, max_memory=8 << 30)
    assert time.monotonic() - t0 < 2
    assert "20 GiB" in str(e.value) and "--max-memory" in str(e.value)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    p = tmp_path / "pipe.pt"
    os.mkfifo(p)
    result = []
    t = threading.Thread(target=lambda: result.append(_error_of(p)), daemon=True)
    t.start()
    t.join(10)
    assert result and "not a regular file" in result[0]


def _error_of(p) -> str:
    try:
        read_file(p)
    except SnapshotError as e:
        return str(e)
    return ""


def test_check_size_leaves_corrupt_zips_to_torch(tmp_path):
    p = tmp_path / "cut.pt"
    torch.save({"x": torch.ones(1000)}, p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    reading.check_size(p, p.stat().st_size, is_zip=True, max_memory=1 << 30)  # no central directory: no opinion
    with pytest.raises(SnapshotError, match="corrupt or truncated"):
        read_file(p)


@pytest.mark.parametrize("keep", [64, 5000, 0.9])
def test_a_cut_off_snapshot_is_called_corrupt_or_truncated(tmp_path, keep):
    """Cut at any point, torch's reader fails differently (a zip error, or an OSError seeking past the end):
    every way is one line that says what is wrong with the file."""
    p = tmp_path / "cut.pt"
    torch.save({"x": torch.randn(20_000), "y": torch.ones(3)}, p)
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(SnapshotError, match="corrupt or truncated"):
        read_file(p)
