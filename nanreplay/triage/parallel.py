"""The parent side of triage's analysis: the snapshots the cache could not answer, run in a WorkerPool."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from nanreplay import interrupt
from nanreplay.errors import PoolError
from nanreplay.triage.cache import save_cache
from nanreplay.triage.plan import Plan, cache_key
from nanreplay.triage.rows import failed, make_row
from nanreplay.triage.worker import WORKER_PRELOAD, analyze_task, worker_init
from nanreplay.triage.workpool import Outcome, PoolStats, WorkerPool

DEFAULT_TIMEOUT = 600.0


def analyze(p: Plan, *, jobs: int, timeout: float | None = DEFAULT_TIMEOUT, progress=None,
            threads: int | None = None, ray: str | None = None) -> PoolStats | None:
    """Analyze every snapshot the cache could not answer, in up to `jobs` worker processes.

    Each worker gets `threads` torch threads [default: the CPUs shared out among the
    workers]. `progress(n)` is called as each snapshot finishes, with its `work` (its bytes). The cache is saved
    as results come in (and on the way out, even on Ctrl-C), so an interrupted run loses little.
    """
    todo = p.todo
    if not todo:
        return None
    by_name = {it.name: it for it in todo}
    workers = min(jobs, len(todo))
    threads = threads or max(1, _cpu_count() // workers)
    tasks = [{"path": it.path, "name": it.name, "outdir": str(p.outdir), "model": p.options.model,
              "loss": p.options.loss, "trust": p.options.trust, "device": p.options.device,
              "verify": p.options.verify, "max_memory": p.options.max_memory, "hash": it.hash_in_worker,
              "timeout": timeout, "threads": threads}
             for it in todo]
    # the workers' confined children make their folders in one of ours: a worker killed (--timeout, Ctrl-C,
    # SIGTERM) cannot remove its own, so this process removes them all, on every way out
    scratch = tempfile.mkdtemp(prefix="nanreplay-triage-")
    for t in tasks:
        t["tmpdir"] = scratch
    fingerprint = p.options.fingerprint()
    if ray is not None:  # `--ray [ADDRESS]`: the same tasks as Ray tasks on an existing cluster (raypool.py)
        from nanreplay.triage.raypool import RayPool

        pool = RayPool(ray, jobs=workers, timeout=timeout, threads=1)
    else:
        pool = WorkerPool(analyze_task, jobs=workers, timeout=timeout, init=worker_init, init_args=(threads,),
                          preload=WORKER_PRELOAD)
    done = [0]

    def finished() -> str:  # Ctrl-C: what this run leaves behind, in the line that says it was interrupted
        return (f"{done[0]} of {len(todo)} snapshots were analyzed (their results are cached: the same command "
                f"continues from there); {p.outdir / 'index.html'} is as it was")

    def remove() -> None:
        for root, dirs, _files in os.walk(scratch):  # the children's folders are read-only (0500)
            for d in dirs:
                try:
                    os.chmod(os.path.join(root, d), 0o700)
                except OSError:
                    pass
        shutil.rmtree(scratch, ignore_errors=True)

    try:
        with interrupt.note(finished), interrupt.cleanup(remove), \
                interrupt.cleanup(lambda: save_cache(p.outdir, p.items, p.old_cache, p.dir)):
            _collect(p, pool, tasks, by_name, fingerprint, progress, done)
    finally:
        remove()
    p.stats = pool.stats
    return pool.stats


def work(it) -> int:
    """A snapshot's share of the run, for the progress bar's ETA: its bytes (what its load, dry run and replays
    scale with — a 500 MB snapshot is not one fiftieth of a run of fifty), at least 1."""
    return max(1, int(it.size or 0))


def _collect(p: Plan, pool: WorkerPool, tasks: list[dict], by_name: dict, fingerprint: str, progress,
             done: list[int]) -> None:
    """Turn each outcome into its row as it comes in, saving the cache every 10 s and on the way out."""
    saved = time.monotonic()
    try:
        for task, outcome in pool.map(tasks):
            it = by_name[task["name"]]
            fields = _fields_of(outcome)
            sha = fields.pop("sha256", None)
            if isinstance(sha, str) and it.sha256 is None:  # hashed by the worker
                it.sha256, it.key = sha, cache_key(sha, fingerprint)
            it.row = make_row(it, fields)
            if outcome.status in ("timeout", "crashed"):
                _remove_debris(p.outdir, it.name)
            done[0] += 1
            if progress is not None:
                progress(work(it))
            if time.monotonic() - saved > 10:
                save_cache(p.outdir, p.items, p.old_cache, p.dir)
                saved = time.monotonic()
    except PoolError as e:
        raise PoolError(f"cannot run the analysis workers: {e}") from None
    finally:
        save_cache(p.outdir, p.items, p.old_cache, p.dir)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


def default_jobs() -> int:
    return _cpu_count()


def _fields_of(outcome: Outcome) -> dict:
    if outcome.status == "ok":
        return dict(outcome.value)
    if outcome.status == "error":
        return failed("internal_error", f"nanreplay bug, please report: {outcome.error}", detail=outcome.detail)
    return failed(outcome.status, outcome.error)


def _remove_debris(out: Path, name: str) -> None:
    """A killed worker may leave an atomic write's temp file behind (`.<name>.html.XXXX.tmp`)."""
    for suffix in ("html", "json"):
        for tmp in out.glob(f".{glob_escape(name)}.{suffix}.*.tmp"):
            tmp.unlink(missing_ok=True)


def glob_escape(s: str) -> str:
    return re.sub(r"([*?[])", r"[\1]", s)
