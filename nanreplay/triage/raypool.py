"""`nanreplay triage DIR -o OUTDIR --ray [ADDRESS]`: the snapshots analyzed as tasks on an existing Ray cluster.

nanreplay runs no scheduler: `ray.init(address=ADDRESS)` joins the cluster that is there (`--ray` alone: the one
RAY_ADDRESS names, else a local one of --jobs CPUs). The snapshots are dealt into chunks; each chunk is one Ray task
(1 CPU, never retried) that runs the chunk through the same WorkerPool a local triage uses: a fresh worker process
(forkserver) whose confined children analyze one snapshot each, under the same --timeout, in a scratch folder of
the task's own that it removes. So a snapshot is analyzed exactly as by a local triage worker, and a worker that dies
is a "crashed" row, not a lost task. The reports are written into OUTDIR by the tasks: on a multi-node cluster,
OUTDIR (and DIR) must be on a file system every node mounts at the same path. Results come back as rows, grouped and
written by the driver as always (the cache included).

The `ray` package is the optional extra `nanreplay[ray]`; nothing imports it unless --ray is given.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator

from nanreplay.errors import PoolError, UsageError
from nanreplay.triage.workpool import Outcome, PoolStats

CHUNKS_PER_WORKER = 4  # more chunks: finer progress and balance; fewer: less worker start-up


class RayPool:
    """WorkerPool's map() over Ray tasks: yields (task, Outcome) as chunks finish."""

    def __init__(self, address: str, *, jobs: int, timeout: float | None, threads: int):
        self.address, self.jobs, self.timeout, self.threads = address, jobs, timeout, threads
        self.stats = PoolStats()

    def map(self, tasks: list[dict]) -> Iterator[tuple[dict, Outcome]]:
        try:
            import ray
        except ImportError:
            raise UsageError("--ray needs the ray package: pip install 'nanreplay[ray]'") from None
        self.stats.started = time.perf_counter()
        if not ray.is_initialized():
            local = self.address in ("", "local")
            try:
                ray.init(address=None if local else self.address, include_dashboard=False, log_to_driver=False,
                         **({"num_cpus": self.jobs} if local and not os.environ.get("RAY_ADDRESS") else {}))
            except Exception as e:  # noqa: BLE001 - cannot reach the cluster: one line
                raise PoolError(f"cannot join the Ray cluster{f' at {self.address}' if not local else ''}: "
                                f"{type(e).__name__}: {e}") from None
        n = max(1, min(len(tasks), self.jobs * CHUNKS_PER_WORKER))
        chunks = [tasks[k::n] for k in range(n)]
        run = ray.remote(num_cpus=1, max_retries=0)(run_chunk)
        refs = {run.remote(chunk, self.timeout, self.threads): chunk for chunk in chunks}
        self.stats.first_ready = time.perf_counter()
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            for ref in done:
                chunk = refs.pop(ref)
                try:
                    results = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the task's process died (node lost, out of memory)
                    msg = " ".join(str(e).split())[:300]
                    results = [(t, Outcome("crashed", error=f"its Ray task died: {type(e).__name__}: {msg}"))
                               for t in chunk]
                yield from results
        self.stats.finished = time.perf_counter()


def run_chunk(chunk: list[dict], timeout: float | None, threads: int) -> list[tuple[dict, Outcome]]:
    """Inside a Ray task: the chunk through a one-worker WorkerPool, as a local triage runs it."""
    from nanreplay.triage.worker import WORKER_PRELOAD, analyze_task, worker_init
    from nanreplay.triage.workpool import WorkerPool

    scratch = tempfile.mkdtemp(prefix="nanreplay-triage-")  # this node's: the confined children's folders
    tasks = [{**t, "tmpdir": scratch} for t in chunk]
    try:
        pool = WorkerPool(analyze_task, jobs=1, timeout=timeout, init=worker_init, init_args=(threads,),
                          preload=WORKER_PRELOAD)
        by_name = {t["name"]: t for t in chunk}
        return [(by_name[t["name"]], o) for t, o in pool.map(tasks)]
    finally:
        for root, dirs, _files in os.walk(scratch):  # the children's folders are read-only (0500)
            for d in dirs:
                try:
                    os.chmod(os.path.join(root, d), 0o700)
                except OSError:
                    pass
        shutil.rmtree(scratch, ignore_errors=True)
