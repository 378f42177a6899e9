"""A guard killed mid-write (kill -9) leaves a hidden temp file; the next guard in that folder removes it once stale."""

from __future__ import annotations

import os
import time

import torch.nn as nn

from nanreplay import NanGuard
from nanreplay.atomic import STALE_AFTER


def test_guard_start_removes_stale_temp_files_of_its_snapshots(tmp_path):
    old = time.time() - STALE_AFTER - 60
    stale = tmp_path / ".nan_step000012_loss_20240101-000000.pt.1a2b3c4d.tmp"
    fresh = tmp_path / ".nan_step000013_loss_20240101-000000.pt.5e6f7a8b.tmp"  # maybe another guard writing now
    foreign = tmp_path / ".checkpoint.pt.1a2b3c4d.tmp"  # not the guard's
    for p in (stale, fresh, foreign):
        p.write_bytes(b"PK")
    for p in (stale, foreign):
        os.utime(p, (old, old))
    NanGuard(nn.Linear(2, 2), folder=tmp_path)
    assert not stale.exists() and fresh.exists() and foreign.exists()
    NanGuard(nn.Linear(2, 2), folder=tmp_path / "not-yet")  # a folder that does not exist yet: nothing to do
    assert not (tmp_path / "not-yet").exists()
