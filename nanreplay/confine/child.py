"""The confined child's main: import what the analysis needs, confine, analyze, send one JSON message back.

Run by `python -m nanreplay.confine JOB` (a fresh interpreter) or in a fork of a triage worker. The
result pipe carries newline-separated JSON objects of one key: `progress` ({stage, doc}: a pass has finished;
doc is the analysis so far, after the culprit's replay), then one of `analysis` (the --json dict),
`error` ({type, message} of a NanReplayError), `memory` (the address-space limit was hit) or `bug`
(any other exception's traceback).
"""

from __future__ import annotations

import json
import os
import traceback

# Imported before the filter; anything else (torch._dynamo: ~1 s, only a replay needs it) lazily after it, the
# installation staying readable. (torch._dynamo's import asks for a cache folder: TORCHINDUCTOR_CACHE_DIR names the
# child's own, read-only one, so it needs no writable temporary folder; nothing is compiled there — only the compile
# child, which has a scratch folder of its own, compiles: differential/compiler.py, docs/trust.md.)
PRELOAD = ("torch", "nanreplay.analysis.pipeline")
COMPILE_FSIZE = 256 << 20  # the compile child: no file it writes (a kernel's source, object, library) beyond this


def main(job: dict) -> None:
    fd = job["result_fd"]
    out = os.fdopen(fd, "wb")
    try:
        data = _encode({"analysis": _analyze({**job, "progress_out": out})})
    except MemoryError:
        data = _encode({"memory": True})
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent as data
        from nanreplay.errors import NanReplayError

        if isinstance(e, NanReplayError):
            msg = {"error": {"type": type(e).__name__, "message": str(e)}}
        elif "can't allocate memory" in str(e) or "not enough memory" in str(e):
            msg = {"memory": True}  # torch's allocator under RLIMIT_AS: a RuntimeError, not a MemoryError
        else:
            msg = {"bug": traceback.format_exc()[-4000:]}
        data = _encode(msg)
    with out:
        out.write(data + b"\n")


def _encode(msg: dict) -> bytes:
    return json.dumps(msg, allow_nan=False).encode("utf-8")


def _analyze(job: dict) -> dict:
    from nanreplay.analysis.pipeline import analyze

    out = job["progress_out"]

    def progress(stage: str, result) -> None:  # the parent prints the culprit block as soon as the replay has it
        doc = result.to_json() if stage == "culprit" else None
        out.write(_encode({"progress": {"stage": stage, "doc": doc}}) + b"\n")
        out.flush()

    from nanreplay.limits import set_work_budget
    from nanreplay.replay.frames import show_relative_to

    state = confine_self(job)
    set_work_budget(job.get("timeout"))  # the dry run refuses a program whose work the time cannot cover
    show_relative_to(job.get("cwd"))
    a = analyze(job["path"], device=job.get("device"), verify=job.get("verify", True), max_memory=job.get("max_memory"),
                loss=job.get("loss"), source=job.get("source"), only_if_needed=False,
                progress=progress if job.get("progress") else None)
    a.environment["confinement"] = state
    return a.to_json()


def confine_self(job: dict) -> dict:
    """Everything the child does before it touches the snapshot: die with its parent, import the analysis,
    then the limits and filters (filters.enter) and the progress page. Returns what is in force."""
    import importlib

    from nanreplay.confine import filters, progress

    filters.die_with_parent(job["parent"])
    for mod in PRELOAD:  # before the filter: imports read the installation freely; nothing of the snapshot yet
        importlib.import_module(mod)
    import torch

    from nanreplay.formats.rebuild import parse_device

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    gpu = parse_device(job.get("device")).type != "cpu"
    limit = job.get("max_memory")
    from nanreplay.replay.frames import python_files_under

    reads = [job["path"], *python_files_under(job.get("source") or [])]  # of --source, its .py files only
    scratch = job.get("scratch")  # the compile child only (differential/compiler.py; docs/trust.md)
    from nanreplay.differential import compiler

    compiler.SANDBOX.update(confined=True, scratch=scratch)
    state = filters.enter(None if gpu else reads, cpu_seconds=job.get("cpu_seconds"),
                          address_space=None if gpu or not limit else _address_space(limit),
                          writes=[scratch, "/dev/null"] if scratch else [], fsize=COMPILE_FSIZE if scratch else 0)
    if gpu:
        state["lost"] = (f"--device {job.get('device')}: no file filter and no address-space limit (the GPU driver "
                         "opens its device files and maps far more address space than it uses)"
                         + (f"; {state['lost']}" if state["lost"] else ""))
    progress.attach(job["progress_fd"])
    progress.at(progress.LOAD, -1)
    return state


def _address_space(max_memory: int) -> int:
    """RLIMIT_AS: what this process has mapped now (Python, torch, its libraries), --max-memory, and headroom."""
    import torch

    from nanreplay.confine import HEADROOM, PER_THREAD

    with open("/proc/self/status") as f:
        mapped = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
    return mapped + max_memory + HEADROOM + PER_THREAD * torch.get_num_threads()
