"""Ctrl-C and `--timeout` for the command: one line, one exit code, no output touched or half-written.

A KeyboardInterrupt raised at a random bytecode is not safe to unwind: it can land inside
torch's own imports (which then leave half-initialised modules behind, and a later op fails
with a RecursionError that gets blamed on the snapshot), inside a library's `except
BaseException`, or inside a write. So the command never raises it. `install()` (the first
thing the `nanreplay` entry point does, before any heavy import) replaces the SIGINT handler
with one that stops the process: it runs the cleanups registered at that moment (kill the
worker processes, remove a write's temp file, save triage's cache), writes
`nanreplay: interrupted` (and the notes registered, e.g. what a triage finished) as one line
on stderr and exits with code 130. `deadline()` stops the same way, with exit code 1.

    install()                               # in the entry point only, never on import
    with cleanup(pool.kill): ...            # run if the process is stopped inside the block
    with note(lambda: "3 of 8 analyzed"):   # appended to the line if stopped inside the block
    with deferred(): write the outputs      # a stop that arrives here waits until the block ends

Library use (`nanreplay.analyze()` from Python) is unchanged: without `install()` Ctrl-C
raises KeyboardInterrupt as usual and the registrations cost nothing.

Standard library only: it is imported before anything else.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT (128 + 2)
TERMINATED = 143  # ... by SIGTERM (128 + 15)

_cleanups: list[Callable[[], object]] = []
_notes: list[Callable[[], str]] = []
_lock = threading.RLock()
_state = {"installed": False, "deferring": 0, "pending": None, "stopping": False}


def install() -> None:
    """Make SIGINT stop the process cleanly (see the module docstring). Only the command's entry point calls it."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _on_sigint)
    signal.signal(signal.SIGTERM, _on_sigterm)  # `kill`, a batch scheduler: the same clean stop (children, temp folders)
    _state["installed"] = True
    atexit.register(_exiting)


def _exiting() -> None:
    """The command is done (its outputs written or its one line said) and the interpreter is shutting down. Python's
    finalisation puts the default SIGINT handler back before it unloads torch (which can take a second), so a Ctrl-C
    landing then killed the finished command by the signal (exit -2, not its own code). Stops are ignored from here:
    there is nothing left to stop cleanly."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def installed() -> bool:
    return bool(_state["installed"])


def _on_sigint(signum, frame) -> None:
    request("nanreplay: interrupted", INTERRUPTED)


def _on_sigterm(signum, frame) -> None:
    request("nanreplay: terminated", TERMINATED)


def request(line: str, code: int) -> None:
    """Stop now with `line` and `code`, or at the end of the current `deferred()` block."""
    with _lock:
        if _state["deferring"]:
            if _state["pending"] is None:
                _state["pending"] = (line, code)
            return
    stop(line, code)


def stop(line: str, code: int) -> None:
    """Run the registered cleanups (newest first), write `line` plus the notes on stderr, exit with `code`."""
    with _lock:
        if _state["stopping"]:  # a second Ctrl-C while cleaning up: the first one's exit is on its way
            return
        _state["stopping"] = True
    for fn in reversed(list(_cleanups)):
        try:
            fn()
        except BaseException:  # noqa: BLE001, S110 - a cleanup that fails must not keep the process alive
            pass
    notes = []
    for fn in list(_notes):
        try:
            notes.append(str(fn()))
        except BaseException:  # noqa: BLE001, S112
            continue
    text = line + "".join(f"; {n}" for n in notes if n)
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001, S110 - stdout may be a closed pipe
        pass
    start = "\n" if _isatty(2) else ""  # off the line that a progress bar or the terminal's ^C left open
    try:
        os.write(2, (start + " ".join(text.split()) + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(code)


@contextmanager
def cleanup(fn: Callable[[], object]) -> Iterator[None]:
    """Run `fn()` if the process is stopped while the block runs."""
    _cleanups.append(fn)
    try:
        yield
    finally:
        _remove(_cleanups, fn)


@contextmanager
def note(fn: Callable[[], str]) -> Iterator[None]:
    """Append `fn()` to the stop line if the process is stopped while the block runs."""
    _notes.append(fn)
    try:
        yield
    finally:
        _remove(_notes, fn)


@contextmanager
def deferred() -> Iterator[None]:
    """Hold a stop that arrives while the block runs until it ends (a set of outputs written all or not at all)."""
    with _lock:
        _state["deferring"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["deferring"] -= 1
            pending = _state["pending"] if not _state["deferring"] else None
            if pending is not None:
                _state["pending"] = None
        if pending is not None:
            stop(*pending)


@contextmanager
def deadline(seconds: float | None, line: str, *, grace: float = 2.0) -> Iterator[None]:
    """Stop with `line` and exit code 1 once `seconds` have passed (None or 0: no limit).

    SIGALRM stops at the next bytecode; one long call into C delays that, so a watchdog thread
    stops the process `grace` seconds later if it still runs. The limit starts when the block does:
    enter it first, and the imports count too. Without `install()` (the command driven in-process, by
    click's test runner) it is `time_limit`: DeadlineExceeded is raised for the caller to report.
    """
    if not seconds or seconds <= 0:
        yield
        return
    if not installed():
        with time_limit(seconds, line):
            yield
        return
    with alarm(seconds, lambda: request(line, 1), lambda: request(line, 1), grace=grace):
        yield


@contextmanager
def alarm(seconds: float, on_alarm: Callable[[], object], on_late: Callable[[], object], *,
          grace: float) -> Iterator[None]:
    """Call `on_alarm` in the main thread (SIGALRM) when `seconds` have passed, and `on_late` from a watchdog
    thread `grace` seconds after that if the body still runs (one long call into C delays a signal handler).
    Off the main thread there is no SIGALRM: the watchdog fires at `seconds`. The one arming of a time limit:
    `deadline` and `time_limit` (in-process analyses) both use it."""
    use_alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    old = None
    if use_alarm:
        old = signal.signal(signal.SIGALRM, lambda signum, frame: on_alarm())
        signal.setitimer(signal.ITIMER_REAL, seconds)
    watchdog = threading.Timer(seconds + (grace if use_alarm else 0), on_late)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)


class DeadlineExceeded(BaseException):
    """Raised in the main thread when a `time_limit` runs out.

    A BaseException, like KeyboardInterrupt: code that catches `Exception` (a user's
    model, a replay that turns errors into data) must not swallow it.
    """


@contextmanager
def time_limit(seconds: float | None, message: str, *, grace: float = 10.0) -> Iterator[None]:
    """Run the body for at most `seconds` (None or 0: no limit).

    When the time is up, DeadlineExceeded is raised in the main thread (SIGALRM); the
    body's cleanup runs as for Ctrl-C. Python cannot interrupt one long call into C, so
    a watchdog thread ends the process `grace` seconds later if the body still runs:
    it writes `message` as one line on stderr and exits with code 1.
    """
    if not seconds or seconds <= 0:
        yield
        return
    with alarm(seconds, _raise_deadline, lambda: _hard_stop(message), grace=grace):
        yield


def _raise_deadline() -> None:
    raise DeadlineExceeded()


def _hard_stop(message: str) -> None:  # pragma: no cover - runs in a process that then ends
    try:
        sys.stderr.flush()
        os.write(2, (message.replace("\n", " ") + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(1)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _remove(items: list, fn) -> None:
    for i in range(len(items) - 1, -1, -1):
        if items[i] is fn:
            del items[i]
            return
