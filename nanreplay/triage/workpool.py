"""A process pool whose workers can be killed: one task per worker at a time, a
per-task timeout that really stops a hung task, and a fresh worker in its place.

`concurrent.futures` and `multiprocessing.Pool` cannot do this: a task that
hangs holds its worker forever, and a worker that dies breaks the whole pool.
Here every worker has its own pipe; the parent waits on all pipes and process
sentinels at once, kills (SIGKILL) a worker whose task ran past its deadline,
reports that task as timed out, and starts a replacement. A worker that dies
(segfault, out-of-memory kill) costs only its own task.

Workers start from a fork server that has already imported `preload` (torch,
the analysis modules), so each worker — and each replacement — costs a fork,
not a fresh interpreter importing torch. Where there is no fork server
(Windows), workers are spawned and import once at start.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from nanreplay import interrupt
from nanreplay.errors import PoolError


@dataclass
class Outcome:
    """What became of one task."""

    status: str  # "ok" | "error" (the task raised) | "timeout" | "crashed" (the worker died)
    value: Any = None  # the task's return value when ok
    error: str = ""  # one line when not ok
    detail: str = ""  # a traceback, when the task raised


@dataclass
class _Worker:
    proc: Any
    conn: Any
    ready: bool = False
    task: tuple[int, Any] | None = None
    deadline: float | None = None


@dataclass
class PoolStats:
    started: float = 0.0
    first_ready: float | None = None  # perf_counter when the first worker could take a task
    finished: float | None = None
    workers_started: int = 0
    killed: int = 0
    extra: dict = field(default_factory=dict)


# The forkserver listens on a Unix socket under the temporary folder (TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX): a
# socket path is at most 107 bytes on Linux, so under a long TMPDIR (a cluster job's scratch folder, pytest's own
# under xdist) it cannot start ("AF_UNIX path too long") and every triage would fail; spawn needs no socket.
_SOCKET_ROOM = 107 - len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def _context():
    import tempfile

    if "forkserver" in multiprocessing.get_all_start_methods() and \
            len(os.fsencode(tempfile.gettempdir())) <= _SOCKET_ROOM:
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")


def _worker_main(conn, fn: Callable, init: Callable | None, init_args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business: it kills us
    try:
        if init is not None:
            init(*init_args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which gives up
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        index, task = msg
        try:
            reply = (index, Outcome("ok", fn(task)))
        except Exception as e:  # noqa: BLE001 - a task's failure is data, not the worker's death
            reply = (index, Outcome("error", error=_one_line(e), detail=traceback.format_exc()))
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send((index, Outcome("error", error=f"cannot send the result back: {_one_line(e)}")))


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _signal_name(code: int | None) -> str:
    if code is None:
        return "unknown status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerPool:
    """Run `fn(task)` for each task in up to `jobs` worker processes.

    `fn`, `init` and tasks must be picklable (module-level functions, plain data).
    `map()` yields `(task, Outcome)` in completion order and never raises for a
    task's own failure; it raises PoolError only when workers cannot start.
    """

    def __init__(self, fn: Callable[[Any], Any], *, jobs: int, timeout: float | None = None,
                 init: Callable | None = None, init_args: tuple = (), preload: Sequence[str] = ()):
        if jobs < 1:
            raise ValueError("jobs must be at least 1")
        self.fn, self.jobs, self.timeout = fn, jobs, timeout if timeout and timeout > 0 else None
        self.init, self.init_args = init, init_args
        self.ctx = _context()
        if self.ctx.get_start_method() == "forkserver" and preload:
            self.ctx.set_forkserver_preload(list(preload))  # no effect once the server runs: harmless
        self.stats = PoolStats()
        self._workers: list[_Worker] = []

    # ---------------------------------------------------------------- workers

    def _start_worker(self) -> _Worker:
        parent, child = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(target=_worker_main, args=(child, self.fn, self.init, self.init_args),
                                daemon=True, name="nanreplay-worker")
        proc.start()
        child.close()
        self.stats.workers_started += 1
        w = _Worker(proc, parent)
        self._workers.append(w)
        return w

    def _stop(self, w: _Worker, *, kill: bool) -> None:
        if kill and w.proc.is_alive():
            w.proc.kill()
            self.stats.killed += 1
        w.proc.join(5)
        if w.proc.is_alive():  # pragma: no cover - SIGKILL cannot be ignored
            w.proc.kill()
            w.proc.join()
        w.conn.close()
        self._workers.remove(w)

    def close(self) -> None:
        """Stop every worker: politely when idle, with SIGKILL when busy."""
        for w in list(self._workers):
            if w.task is None and w.proc.is_alive():
                try:
                    w.conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + 5
        for w in list(self._workers):
            if w.task is None:
                w.proc.join(max(0.0, deadline - time.monotonic()))
            self._stop(w, kill=True)

    # ---------------------------------------------------------------- running

    def map(self, tasks: Iterable[Any]) -> Iterator[tuple[Any, Outcome]]:
        pending: deque[tuple[int, Any]] = deque(enumerate(tasks))
        if not pending:
            return
        self.stats.started = time.perf_counter()
        start_failures = 0
        stack = ExitStack()
        stack.enter_context(interrupt.cleanup(self.kill))  # Ctrl-C: no worker goes on writing reports
        try:
            for _ in range(min(self.jobs, len(pending))):
                self._start_worker()
            while pending or any(w.task is not None for w in self._workers):
                for w in self._workers:
                    if w.ready and w.task is None and pending:
                        w.task = pending.popleft()
                        w.deadline = time.monotonic() + self.timeout if self.timeout else None
                        w.conn.send(w.task)
                deadlines = [w.deadline for w in self._workers if w.deadline is not None]
                wait_for = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                wait([o for w in self._workers for o in (w.conn, w.proc.sentinel)], wait_for)
                for w in list(self._workers):
                    yield from self._drain(w)
                    if not w.proc.is_alive():
                        if w.task is not None:
                            task = w.task
                            w.task = None
                            yield task[1], Outcome("crashed", error=f"the worker process died "
                                                                    f"({_signal_name(w.proc.exitcode)})")
                        elif not w.ready:
                            start_failures += 1
                            if start_failures >= 3:
                                raise PoolError(f"analysis workers keep dying at start "
                                                f"({_signal_name(w.proc.exitcode)})")
                        self._stop(w, kill=False)
                        self._replace_if_needed(pending)
                    elif w.task is not None and w.deadline is not None and time.monotonic() >= w.deadline:
                        task = w.task
                        w.task = None
                        self._stop(w, kill=True)
                        self._replace_if_needed(pending)
                        yield task[1], Outcome("timeout", error=f"no result after {self.timeout:g} s "
                                                                "(the worker was killed)")
            self.stats.finished = time.perf_counter()
        finally:
            stack.close()
            self.close()

    def kill(self) -> None:
        """Stop every worker at once (SIGKILL), whatever it is doing."""
        for w in self._workers:
            if w.proc.is_alive():
                w.proc.kill()

    def _replace_if_needed(self, pending: deque) -> None:
        if pending and len(self._workers) < min(self.jobs, len(pending) + self._busy()):
            self._start_worker()

    def _busy(self) -> int:
        return sum(w.task is not None for w in self._workers)

    def _drain(self, w: _Worker) -> Iterator[tuple[Any, Outcome]]:
        """Every message the worker has sent: readiness and finished tasks."""
        while True:
            try:
                if not w.conn.poll():
                    return
                msg = w.conn.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            if kind == "ready":
                w.ready = True
                if self.stats.first_ready is None:
                    self.stats.first_ready = time.perf_counter()
            elif kind == "init_error":
                raise PoolError(f"an analysis worker could not start: {msg[1]}")
            elif w.task is not None and kind == w.task[0]:
                task = w.task
                w.task, w.deadline = None, None
                yield task[1], msg[1]
