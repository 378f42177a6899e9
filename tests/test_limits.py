"""nanreplay.limits: sizes, the default memory limit, and a time limit that interrupts Python code."""

from __future__ import annotations

import time

import pytest

from nanreplay import interrupt, limits


@pytest.mark.parametrize("text,size", [("8G", 8 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("100000", 100000),
                                       ("64k", 64 << 10), ("2 GB", 2 << 30), ("1T", 1 << 40), (".5K", 512)])
def test_parse_size(text, size):
    assert limits.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "8X", "-1G", "0", "1e9", "G"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        limits.parse_size(text)


def test_default_max_memory_is_a_share_of_what_is_available(monkeypatch):
    monkeypatch.setattr(limits, "available_memory", lambda: 10 << 30)
    assert limits.default_max_memory() == int(0.6 * (10 << 30))
    monkeypatch.setattr(limits, "available_memory", lambda: None)
    assert limits.default_max_memory() == limits.FALLBACK_MEMORY
    monkeypatch.undo()
    real = limits.default_max_memory()
    assert 1 << 20 <= real and (limits.available_memory() is None or real <= limits.available_memory())


def test_time_limit_interrupts_a_sleep_and_a_busy_loop_and_code_that_catches_exception():
    for body in (lambda: time.sleep(30), _busy, _swallowing):
        t0 = time.monotonic()
        with pytest.raises(interrupt.DeadlineExceeded), interrupt.time_limit(0.3, "unused"):
            body()
        assert time.monotonic() - t0 < 5


def test_time_limit_off_and_restored():
    with interrupt.time_limit(0, "unused"):
        time.sleep(0.05)
    with interrupt.time_limit(5, "unused"):
        pass
    time.sleep(0.1)  # no alarm left behind


def _busy():
    while True:
        sum(range(1000))


def _swallowing():
    while True:
        try:
            time.sleep(1)
        except Exception:  # noqa: BLE001 - user code does this; the deadline must get through
            pass


def test_format_size():
    assert limits.format_size(3 << 29) == "1.5 GiB" and limits.format_size(300) == "300 B"
