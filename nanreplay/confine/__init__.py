"""Analyze an untrusted snapshot in a confined child process; this process only reads its JSON back.

    d = confine.analyze(path, device=..., verify=..., max_memory=..., source=..., timeout=...)  # the --json dict
    d = confine.analyze(..., fork=True)  # a triage worker: fork (torch imported, no op run yet) instead of a new Python

The child (`python -m nanreplay.confine`, or a fork) holds nothing of the analyst's: an empty private
working folder that it cannot write to either, a minimal environment, no descriptor but its result pipe and
a one-page progress memfd (stdin/stdout/stderr are /dev/null), and a new session (Ctrl-C and --timeout in
this process kill its whole group). It imports torch and the analysis, then confines itself
(filters.enter: resource limits, Landlock, seccomp) and only then opens the snapshot. Its one message on the
pipe is strict JSON: the analysis, a NanReplayError (type and message), a memory-limit hit, or a bug's
traceback. A child killed by a signal is one line: the op and node it was running (progress.py), or the
limit it hit. What confinement was in force is in the analysis's `environment.confinement`.

Loading, the dry run, the replay, the diagnosis replays and the precision probe all run in the child;
rendering (report, Markdown, terminal) happens here, from the JSON alone — this process never imports torch.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from nanreplay import errors, interrupt
from nanreplay.confine.result import analysis_problem, checked_tree, sanitize_tree
from nanreplay.errors import ConfinedCrash, LimitError, ReplayError, SnapshotError, TimeLimitError
from nanreplay.sanitize import one_line

# Address space for torch itself, beyond --max-memory: measured in the child when it confines itself (what it
# has mapped after importing torch), plus room for each thread's stack and malloc arena and the analysis's own
# Python objects.
HEADROOM = 1 << 30
PER_THREAD = 80 << 20
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGFPE, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGSYS,
                  signal.SIGTRAP}
_OP_NAME = re.compile(r"aten\.[A-Za-z0-9_]{1,80}\.[A-Za-z0-9_]{1,40}")
_REQUIRED = ("schema", "snapshot", "verdict", "diagnosis", "environment", "stats")
# What the child keeps of the analyst's environment: thread counts, the visible devices, and the math libraries'
# code-path settings (the analysis must compute with the kernels the analyst chose: a confined and an unconfined
# analysis under ATEN_CPU_CAPABILITY=avx2 gave two different losses). Values, never paths or secrets.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
                "OPENBLAS_CORETYPE")


def needed(*, trust: bool, model: str | None, loss: str | None) -> bool:
    """Whether an analysis is confined: on Linux always, unless it runs code the user named (`--trust`,
    `--model`, a `--loss MODULE:CALLABLE`), which runs as the user anyway. (Elsewhere: not yet, docs/trust.md.)"""
    return sys.platform.startswith("linux") and not (trust or model or (loss and ":" in loss))


def weaker(doc: object) -> str | None:
    """The terminal line for an analysis that ran less confined than docs/trust.md describes (no Landlock on this
    kernel, seccomp refused, a limit lowered by `ulimit`, `--device cuda`): the child's own
    `environment.confinement.lost`, escaped, or None. Before, only the JSON said so."""
    c = ((doc.get("environment") or {}).get("confinement") if isinstance(doc, dict) else None) or {}
    lost = c.get("lost") if isinstance(c, dict) else None
    if not lost:
        return None
    return f"nanreplay: warning: the analysis ran less confined than usual: {one_line(str(lost), 600)}"


def no_file_filter() -> str | None:
    """Triage's line, said once before it starts: this kernel has no Landlock, so no snapshot's analysis has its
    files filtered (each child still records it in its JSON). None where Landlock is there (or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    from nanreplay.confine import filters

    if filters.landlock_abi() is not None:
        return None
    return ("nanreplay: warning: no Landlock on this kernel: the snapshots' analyses run confined without a file "
            "filter (only the limits, seccomp and an empty private folder hold)")


def analyze(path: str, *, device: str | None = None, verify: bool = True, max_memory: int | None = None,
            source: list[str] | None = None, loss: str | None = None, timeout: float | None = None,
            threads: int | None = None, fork: bool = False, progress=None, compile_replay: bool = False,
            tmpdir: str | None = None, ticker=None) -> dict:
    """The analysis JSON of `path`, computed in a confined child. Raises the child's NanReplayError (the
    snapshot's path as given here), ConfinedCrash (a signal), LimitError / TimeLimitError (a limit hit).
    A compiled step is replayed compiled (a compile child: inductor and the C++ compiler) only when the snapshot
    is small or `compile_replay` says so. `ticker(status)` is called a few times a second while the child runs,
    with progress.status's tuple."""
    _check_kind(path)
    job = {"path": os.path.abspath(path), "shown": str(path), "cwd": os.getcwd(), "device": device, "verify": verify,
           "max_memory": max_memory, "loss": loss, "threads": threads, "timeout": timeout,
           "source": [os.path.abspath(s) for s in source] if source is not None else None,
           "cpu_seconds": _cpu_seconds(timeout, threads), "progress": progress is not None, "tmpdir": tmpdir}
    d = run(job, fork=fork, progress=progress, ticker=ticker)
    if not _wants_compile(d):
        return d
    why_not = None if compile_replay else _too_big_to_compile(path, d)
    if why_not:
        return _not_compiled(d, why_not)
    t = min(timeout or COMPILE_SECONDS, COMPILE_SECONDS)  # its own time bound
    return _compiled_replay(d, {**job, "timeout": t, "cpu_seconds": _cpu_seconds(t, threads)})


COMPILE_SMALL_BYTES = 4 << 20  # a snapshot this small (and of at most COMPILE_SMALL_NODES ops) is replayed compiled
COMPILE_SMALL_NODES = 2000  # without --compile-replay


def _too_big_to_compile(path: str, d: dict) -> str | None:
    try:
        size = os.stat(path).st_size if os.path.isfile(path) else COMPILE_SMALL_BYTES + 1
    except OSError:
        size = COMPILE_SMALL_BYTES + 1
    ops = (d.get("stats") or {}).get("ops_forward")
    if size <= COMPILE_SMALL_BYTES and isinstance(ops, int) and ops <= COMPILE_SMALL_NODES:
        return None
    return (f"the snapshot is not small ({_size(size)}, {ops if isinstance(ops, int) else 'an unknown number of'} "
            "ops): inductor and the C++ compiler run on a stranger's step only with --compile-replay")


def _not_compiled(d: dict, why: str) -> dict:
    c = d["differential"]["compiler"]
    c["skipped"] = why
    c["sentence"] = f"Not replayed compiled here: {why}."
    d["diagnosis"]["explanation"] = f"{d['diagnosis'].get('explanation', '')} {c['sentence']}".strip()
    return d


def _wants_compile(d: dict) -> bool:
    """The analysis asked the compiler's question and could not answer it in this child (no folder to compile in)."""
    c = (d.get("differential") or {}).get("compiler")
    return isinstance(c, dict) and c.get("skipped_for") == "sandbox"


def _compiled_replay(d: dict, job: dict) -> dict:
    """The same analysis in a compile child: a fresh Python whose sandbox also lets it write (files of at most
    child.COMPILE_FSIZE) in a scratch folder of its own, removed afterwards, and run the C++ compiler there — the
    only widening, for the one analysis that needs it (docs/trust.md). Where that child fails, the first
    analysis stands, its compiler record saying why in one line."""
    try:
        return run({**job, "compile": True, "progress": False})
    except (errors.NanReplayError, ConfinedCrash, RuntimeError) as e:
        return _not_compiled(d, f"the compile child failed: {errors.first_line(e, 300)}")


def _check_kind(path: str) -> None:
    """A missing path, a FIFO or a device is refused here, by stat alone (nothing is opened), without a child;
    the child checks again (formats/reading.py) and reads the file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise SnapshotError(f"{path}: not a regular file, not a snapshot")


def run(job: dict, *, fork: bool = False, entry: str = "nanreplay.confine", progress=None, ticker=None) -> dict:
    """Run `job` in a confined child (`python -m ENTRY JOB`, or a fork running child.main) and return what it
    sent back, checked. Tests give their own `entry` (a script) to run probes in the same sandbox. `progress(stage,
    doc)` is called for each pass the child reports before its result (analyze(progress=) in the child)."""
    job = {**job, "parent": os.getpid()}
    if not fork:
        _bytecode_ready()
    base = job.get("tmpdir") if job.get("tmpdir") and os.path.isdir(job["tmpdir"]) else None  # (triage's)
    work = tempfile.mkdtemp(prefix="nanreplay-confined-", dir=base)
    os.chmod(work, 0o500)  # empty, and stays so: the child cannot write there either
    scratch = tempfile.mkdtemp(prefix="nanreplay-compile-", dir=base) if job.get("compile") else None  # 0700, ours
    if scratch:
        job["scratch"] = scratch

    def remove() -> None:  # every exit path: the result, an error, Ctrl-C or SIGTERM (interrupt.stop runs it)
        try:
            os.chmod(work, 0o700)
        except OSError:
            pass
        shutil.rmtree(work, ignore_errors=True)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)

    page = -1
    try:
        with interrupt.cleanup(remove):
            page = os.memfd_create("nanreplay-progress")
            os.ftruncate(page, 4096)
            reader = _Messages(job, progress, ticker, page)
            status, text = _fork(job, work, page, reader) if fork and not scratch else \
                _spawn(job, work, page, entry, reader)
            return _result(job, status, text, page, job.get("timeout"), job.get("max_memory"))
    finally:
        if page >= 0:
            os.close(page)
        remove()


_bytecode_checked = False


def _bytecode_ready() -> None:
    """nanreplay's own modules compiled to bytecode, by this trusted process, where Python may write it.

    The child runs with -B: it may write nothing outside its outputs (a child that could write the package's
    bytecode could plant code this process runs unconfined). A wheel's install compiled them; an editable install
    or a source checkout has bytecode only for the few modules this process imported, so every child compiled the
    other ~140 from source (~0.2 s CPU an analysis). compileall compiles only what is missing or stale; a folder
    this user may not write is left as it is. PYTHONDONTWRITEBYTECODE / -B are obeyed."""
    global _bytecode_checked
    if sys.dont_write_bytecode or _bytecode_checked:
        return
    _bytecode_checked = True  # once a process (triage starts a child per snapshot)
    import compileall

    import nanreplay

    try:
        compileall.compile_dir(os.path.dirname(os.path.abspath(nanreplay.__file__)), quiet=2, workers=1)
    except Exception:  # noqa: BLE001 - an optimisation: the child compiles in memory, as before
        pass


def _cpu_seconds(timeout: float | None, threads: int | None) -> int | None:
    """RLIMIT_CPU from --timeout: every thread's CPU time counts, so the wall-clock limit times the threads."""
    if not timeout:
        return None
    return int(timeout * (threads or os.cpu_count() or 1)) + 1


def minimal_env(work: str, scratch: str | None = None) -> dict[str, str]:
    """What the child may know of the analyst's environment: nothing but where nanreplay is and torch's thread
    settings. A compile child's temporary files and inductor's cache go to its scratch folder, and inductor
    compiles in this process (one compile thread: no pool of workers)."""
    import nanreplay

    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work, "TORCHINDUCTOR_CACHE_DIR": work,
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(nanreplay.__file__))),
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}
    if scratch:
        env.update(TMPDIR=scratch, TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"),
                   TORCHINDUCTOR_COMPILE_THREADS="1", TRITON_CACHE_DIR=os.path.join(scratch, "triton"))
    env.update({k: os.environ[k] for k in _THREAD_VARS if k in os.environ})
    return env


def _spawn(job: dict, work: str, page: int, entry: str, reader: _Messages) -> tuple[int, bytes]:
    r, w = os.pipe()
    job = {**job, "result_fd": w, "progress_fd": page}
    try:
        cmd = [sys.executable, "-s", "-B", *([entry] if entry.endswith(".py") else ["-m", entry]), json.dumps(job)]
        proc = subprocess.Popen(cmd, cwd=work, env=minimal_env(work, job.get("scratch")), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, close_fds=True, pass_fds=(w, page), start_new_session=True)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    try:
        with interrupt.cleanup(lambda: stop_group(proc.pid)):  # Ctrl-C or --timeout end the command: the child too
            text = reader.read(r, lambda: _running(proc.pid))
        return _end(proc.pid, lambda: proc.wait()), text
    except BaseException:  # --timeout, Ctrl-C, a result past its bounds: stop the child and all it started
        stop_group(proc.pid)
        proc.wait()
        raise


def _fork(job: dict, work: str, page: int, reader: _Messages) -> tuple[int, bytes]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; coverage cannot follow it
        code = 1
        try:
            os.setsid()
            os.close(r)
            _close_fds_except({0, 1, 2, w, page})  # the worker's own pipe to triage's parent included
            os.chdir(work)
            os.environ.clear()
            os.environ.update(minimal_env(work))
            from nanreplay.confine import filters

            filters.wipe_initial_environment()  # what /proc/self/environ shows: the worker's original block
            from nanreplay.confine import child

            child.main({**job, "result_fd": w, "progress_fd": page})
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        with interrupt.cleanup(lambda: stop_group(pid)):
            text = reader.read(r, lambda: _running(pid))
        return _end(pid, lambda: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])), text
    except BaseException:
        stop_group(pid)
        os.waitpid(pid, 0)
        raise


def _close_fds_except(keep: set[int]) -> None:  # pragma: no cover - runs in the forked child
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


MAX_RESULT = 256 << 20  # bytes the child may send in all (an analysis of a large program is a few MiB)
MAX_LINE = 128 << 20  # bytes of one message
EXIT_GRACE = 5.0  # seconds a child may take to exit after its result (or a grandchild to let go of the pipe)
DEADLINE_GRACE = 30.0  # seconds past --timeout before the pipe is given up (the command's own deadline comes first)
SCRATCH_LIMIT = 2 << 30  # bytes the compile child's scratch folder may hold in all
COMPILE_SECONDS = 300.0  # the compile child's own time bound


class _Messages:
    """The result pipe: newline-separated JSON messages, each a dict of one entry; `progress` messages ({stage,
    doc}) go to the callback as they arrive, the last message is the child's result. Nothing from the child is
    trusted: the bytes are bounded (in all and per message) and gathered in linear time, the pipe is read with a
    deadline, and reading stops once the child has exited even if a process it started still holds the pipe."""

    TICK = 0.25  # seconds between two calls of the ticker

    def __init__(self, job: dict, progress, ticker=None, page: int | None = None):
        self.job, self.progress, self.ticker, self.page = job, progress, ticker, page
        self.ticked = 0.0
        t = job.get("timeout")
        self.deadline = time.monotonic() + t + DEADLINE_GRACE if t else None
        self.scratch = job.get("scratch")

    def read(self, fd: int, running=lambda: True) -> bytes:
        parts: list[bytes] = []
        pending = total = 0
        last = b""
        gone = None
        checked = time.monotonic()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        shown = self.job["shown"]
        try:
            while True:
                now = time.monotonic()
                if self.deadline is not None and now > self.deadline:
                    raise TimeLimitError(f"{shown}: the confined analysis sent no result within --timeout "
                                         f"{self.job['timeout']:g} s and was stopped; nothing was written")
                if self.scratch and now - checked > 1.0:
                    checked = now
                    if _folder_size(self.scratch) > SCRATCH_LIMIT:
                        raise LimitError(f"{shown}: the compile child's scratch folder grew past "
                                         f"{_size(SCRATCH_LIMIT)} and was stopped; nothing was written")
                if self.ticker is not None and self.page is not None and now - self.ticked >= self.TICK:
                    from nanreplay.confine import progress as progress_page
                    self.ticked = now
                    self.ticker(progress_page.status(self.page))  # what the child is doing, for the status line
                if not poller.poll(200 if self.ticker is None else int(self.TICK * 1000)):
                    if not running():
                        gone = gone if gone is not None else now
                        if now - gone > EXIT_GRACE:  # a process the child started holds the pipe: stop reading
                            break
                    continue
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                total += len(chunk)
                if total > MAX_RESULT:
                    raise ReplayError(f"{shown}: the confined analysis sent back more than {_size(MAX_RESULT)}; "
                                      "nothing was written")
                while (k := chunk.find(b"\n")) >= 0:
                    parts.append(chunk[:k])
                    line, parts, pending = b"".join(parts), [], 0
                    chunk = chunk[k + 1:]
                    if line and not self._progress(line):
                        last = line
                if chunk:
                    parts.append(chunk)
                    pending += len(chunk)
                    if pending > MAX_LINE:
                        raise ReplayError(f"{shown}: the confined analysis sent a message of more than "
                                          f"{_size(MAX_LINE)}; nothing was written")
        finally:
            os.close(fd)
        return b"".join(parts) or last

    def _progress(self, line: bytes) -> bool:
        msg = _message(line)
        if not msg or "progress" not in msg:
            return False
        body = msg["progress"]
        if self.progress is not None and isinstance(body, dict) and isinstance(body.get("doc"), dict):
            doc = body["doc"]
            if checked_tree(doc) is None:
                doc = sanitize_tree(doc)
                doc["snapshot"] = self.job["shown"]
                _local_paths_only_under(doc, self.job.get("source") or [])
                try:
                    self.progress(str(body.get("stage"))[:40], doc)
                except (TypeError, KeyError, AttributeError, ValueError, IndexError):
                    pass  # a progress block the terminal cannot show: the final result is checked in full
        return True


def _running(pid: int) -> bool:
    """Whether the child has not exited yet (it is not reaped: the caller still waits for it)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _end(pid: int, reap) -> int:
    """After the result: give the child EXIT_GRACE seconds to exit, then kill its whole process group (anything it
    started, even a process that let go of the pipe) before reaping it (so its pid, the group's id, cannot be
    reused meanwhile). A child killed here after its complete result counts as having exited."""
    end = time.monotonic() + EXIT_GRACE
    while _running(pid) and time.monotonic() < end:
        time.sleep(0.02)
    late = _running(pid)
    stop_group(pid)
    status = reap()
    return 0 if late and status == -signal.SIGKILL else status


def _folder_size(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def stop_group(pid: int) -> None:
    """SIGKILL a child's whole process group (it leads its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- what came back


def _result(job: dict, status: int, text: bytes, page: int, timeout: float | None, max_memory: int | None) -> dict:
    shown = job["shown"]
    msg = _message(text)
    if status < 0 or msg is None:
        raise _died(shown, status, page, timeout, max_memory)
    kind, body = next(iter(msg.items()))
    if kind == "analysis" and isinstance(body, dict):
        why = analysis_problem(body)
        if why:
            raise ReplayError(f"{shown}: the confined analysis sent back something that is not an analysis ({why}); "
                              "nothing was written")
        body = sanitize_tree(body)
        body["snapshot"] = shown
        _local_paths_only_under(body, job.get("source") or [])
        return body
    if kind == "error" and isinstance(body, dict):
        cls = getattr(errors, str(body.get("type"))[:100], None)
        if not (isinstance(cls, type) and issubclass(cls, errors.NanReplayError)):
            cls = ReplayError
        text = str(body.get("message"))[:SHOWN_MESSAGE].replace(job["path"], shown)
        raise cls(one_line(text, SHOWN_MESSAGE))
    if kind == "memory":
        raise LimitError(f"{shown}: the analysis ran out of memory under {_memory_cap(max_memory)}; nothing was "
                         "written")
    if kind == "bug":  # each line of the child's traceback escaped and indented: none can pass for one of ours
        lines = str(body)[-SHOWN_MESSAGE:].splitlines()[-60:]
        shown_tb = "\n".join("  | " + one_line(ln, 300) for ln in lines)
        raise RuntimeError(f"the confined analysis of {shown} failed (a bug in nanreplay, please report):\n{shown_tb}")
    raise ReplayError(f"{shown}: the confined analysis sent back something that is not an analysis; nothing was "
                      "written")


SHOWN_MESSAGE = 4000  # characters of an error message or traceback from the child


def _local_paths_only_under(d, roots: list[str]) -> None:
    """The report reads a source line's `path` from this process: keep only paths under a folder the user named
    (--source), resolved, and only with the lines the snapshot recorded as their context, so that not even a child
    taken over by a kernel exploit can make it quote a local file."""
    real = [os.path.realpath(r) for r in roots]
    stack = [d]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            p = x.get("path")
            if isinstance(p, str) and "line" in x and "context" in x and not isinstance(x["context"], dict):
                x["path"] = None  # a snapshot's frame: shown with the lines it recorded, never a local file's
            if isinstance(p, str) and "line" in x and not any(
                    os.path.commonpath([os.path.realpath(p), r]) == r for r in real if os.path.isabs(p)):
                x["path"] = None
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _message(text: bytes) -> dict | None:
    """The child's one message, parsed strictly (no NaN/Infinity, no duplicate keys): a dict of one entry."""
    def no_constant(name: str):
        raise ValueError(f"non-standard JSON number {name}")

    def no_duplicates(pairs):
        d = dict(pairs)
        if len(d) != len(pairs):
            raise ValueError("duplicate key")
        return d

    try:
        d = json.loads(text.decode("utf-8"), parse_constant=no_constant, object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) and len(d) == 1 else None


def _died(shown: str, status: int, page: int, timeout: float | None, max_memory: int | None) -> Exception:
    from nanreplay.confine import progress

    if status >= 0:
        return ReplayError(f"{shown}: the confined analysis ended without a result (exit code {status}); nothing "
                           "was written")
    sig = -status
    name = _signal_name(sig)
    if sig == signal.SIGXCPU:
        return TimeLimitError(f"{shown}: the analysis used up its CPU time (--timeout {timeout:g} s, times the "
                              "threads) and was stopped; nothing was written")
    if sig == signal.SIGKILL:
        return LimitError(f"{shown}: the analysis was killed (SIGKILL: out of memory, or past its CPU time) under "
                          f"{_memory_cap(max_memory)}; nothing was written")
    where = progress.read(page)
    # the page is the child's memory: an op name is quoted only in the form an allowlisted op has (a child taken
    # over could otherwise write a sentence of its own into nanreplay's crash line)
    if where is not None and where[1] >= 0 and _OP_NAME.fullmatch(where[2]) and sig in _CRASH_SIGNALS:
        phase, node, op = where
        return ConfinedCrash(f"{shown}: the snapshot's step crashed torch's `{op}` kernel at node {node} ({name} in "
                             f"{phase}; a crafted or corrupt snapshot); nothing was written")
    during = f" in {where[0]}" if where is not None else ""
    return ConfinedCrash(f"{shown}: the snapshot's step crashed torch ({name}{during}; a crafted or corrupt "
                         "snapshot); nothing was written")


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _memory_cap(max_memory: int | None) -> str:
    """The limit the child's address space had: --max-memory, or the smaller one this process already runs under
    (`ulimit -v` on a cluster node), which the child inherits and cannot raise."""
    import resource

    inherited = [v for v in resource.getrlimit(resource.RLIMIT_AS) if v != resource.RLIM_INFINITY]
    cap = min(inherited) if inherited else None
    if cap is not None and (not max_memory or cap < max_memory):
        return (f"the address-space limit this command inherited ({_size(cap)}: `ulimit -v`, below --max-memory "
                f"{_size(max_memory)}); raise it with `ulimit -v`, or analyze where it is higher")
    return f"--max-memory {_size(max_memory)} (its address space was capped there, plus torch's own)"


def _size(n: int | None) -> str:
    from nanreplay.limits import format_size

    return format_size(n) if n else "(none)"
