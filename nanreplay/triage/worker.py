"""The worker side of triage: one process analyzes one snapshot at a time and writes its report and JSON."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from nanreplay import atomic
from nanreplay.errors import ConfinedCrash, LimitError, NanReplayError, ReplayError, SnapshotError, TrustError
from nanreplay.triage.plan import content_hash, path_stat
from nanreplay.triage.rows import failed

# Modules a worker needs, imported once: by the fork server (each worker is then a cheap
# fork) or, without one, by each worker at start. torch._dynamo is what a step program's meta
# dry run would otherwise import lazily (torch's Python meta kernels are behind it): about 1.5 s.
WORKER_PRELOAD = ("torch", "torch._dynamo", "jinja2", "nanreplay.analysis", "nanreplay.diagnose",
                  "nanreplay.verify", "nanreplay.report.html", "nanreplay.triage")


def worker_init(threads: int) -> None:
    """Once per worker: quiet its output, size torch's thread pool, import what analysis needs."""
    import importlib

    devnull = os.open(os.devnull, os.O_WRONLY)  # user models print; the progress bar must stay clean
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    for mod in WORKER_PRELOAD:  # a no-op under the fork server, which imported them already
        importlib.import_module(mod)
    import torch

    torch.set_num_threads(threads)


def analyze_task(task: dict) -> dict:
    """Worker side: analyze one snapshot, write its report and JSON, return its row's fields.

    With `task["hash"]` the worker hashes the file first (a big file the parent left to it):
    the fields then carry `sha256`.
    """
    fields = _hash_first(task) if task.get("hash") else {}
    if "status" in fields:
        return fields
    result = _analyze(task)
    return {**result, **fields}


def _hash_first(task: dict) -> dict:
    """{"sha256": ...}, or nothing for a file over the memory limit (its analysis refuses it at once),
    or a failed row when it cannot be read."""
    limit = task.get("max_memory")
    try:
        if limit and path_stat(task["path"])[0] > limit:
            return {}
        return {"sha256": content_hash(task["path"])}
    except OSError as e:
        return failed("unreadable", f"cannot read: {e.strerror or e}")


def _analyze(task: dict) -> dict:
    from nanreplay import confine
    from nanreplay.report.html import write_report

    t0 = time.perf_counter()
    try:
        if confine.needed(trust=task["trust"], model=task["model"], loss=task["loss"]):
            # a fork of this worker (torch imported, no op run) confines itself and analyzes; we render its JSON
            d = confine.analyze(task["path"], device=task.get("device"), verify=task.get("verify", True),
                                max_memory=task.get("max_memory"), loss=task["loss"], timeout=task.get("timeout"),
                                threads=task.get("threads"), fork=True, tmpdir=task.get("tmpdir"))
        else:
            from nanreplay.analysis import analyze as analyze_one

            # --model/--loss name the model of plain state-dict snapshots: a snapshot that carries its own step
            # is replayed as it is, so one folder can hold both kinds
            d = analyze_one(task["path"], model=task["model"], loss=task["loss"], trust=task["trust"],
                            device=task.get("device"), verify=task.get("verify", True),
                            max_memory=task.get("max_memory"), only_if_needed=True).to_json()
    except NanReplayError as e:
        return failed(_category(e), str(e), path=task["path"])
    seconds = time.perf_counter() - t0
    out = Path(task["outdir"])
    report, js = f"{task['name']}.html", f"{task['name']}.json"
    try:
        atomic.write_text(out / js, json.dumps(d, indent=2, allow_nan=False))
        write_report(d, str(out / report), index="index.html")  # the report links back to the index
    except (OSError, NanReplayError) as e:
        for f in (report, js):
            (out / f).unlink(missing_ok=True)
        return failed("output_error", str(e))
    fields = analysis_fields(d)
    fields.update(seconds=round(seconds, 4), write_seconds=round(time.perf_counter() - t0 - seconds, 4),
                  report=report, json=js)
    return fields


def _category(e: NanReplayError) -> str:
    if isinstance(e, ConfinedCrash):
        return "crashed"
    if isinstance(e, TrustError):
        return "refused"
    if isinstance(e, LimitError):
        return "over_limit"
    if isinstance(e, ReplayError):
        return "replay_error"
    if isinstance(e, SnapshotError):
        return "unreadable"
    return "not_replayable"


def _inf_sign(c: dict) -> str | None:
    """An Inf culprit's sign as its output counts say: "+", "-" or "+-" (what the summaries need to keep −Inf)."""
    out = c.get("output") or {}
    if c.get("kind") != "inf":
        return None
    sign = ("+" if out.get("posinf") else "") + ("-" if out.get("neginf") else "")
    return sign or None


def _flow_site(d: dict) -> dict:
    """A dead-gradient analysis' site (where the first parameter's flow ends) in the culprit's shape: the same
    grouping then holds (verdict, cause, op, module, line)."""
    gf = d.get("gradient_flow") or {}
    row = next((r for r in gf.get("per_parameter") or [] if isinstance(r, dict) and r.get("verdict") == d.get("verdict")),
               None)
    if row is None:
        return {}
    return {"op": row.get("op"), "forward_op": row.get("forward_op"), "module": row.get("module"),
            "kind": row.get("kind"), "phase": "backward" if d.get("verdict") == "gradient_zero" else "forward",
            "source": row.get("source") or {}}


def analysis_fields(d: dict) -> dict:
    """The summary-row fields of one analysis (its contract JSON)."""
    c = d.get("culprit") or _flow_site(d)
    diag = d.get("diagnosis") or {}
    fix = diag.get("fix") or {}
    src = c.get("source") or {}
    info = d.get("snapshot_info") or {}
    code = fix.get("after") or fix.get("code") or ""
    machine = (d.get("differential") or {}).get("machine") or {}
    ident = machine.get("identity") or {}
    return {
        "status": "analyzed", "verdict": d.get("verdict"), "cause": diag.get("cause"), "title": diag.get("title"),
        "op": c.get("op"), "forward_op": c.get("forward_op"), "backward_node": c.get("backward_node"),
        "phase": c.get("phase"), "kind": c.get("kind"), "inf_sign": _inf_sign(c), "module": c.get("module"),
        "source": f"{src['file']}:{src['line']}" if src.get("file") else None,
        "source_path": src.get("path") or src.get("file"), "source_line": (src.get("line") or None) if src else None,
        "code": src.get("code"), "function": src.get("function") if src else None,
        "fix_kind": fix.get("kind"), "fix_code": code, "fix_verified": fix.get("verified"),
        "step": info.get("step"), "rank": info.get("rank"), "world_size": info.get("world_size"),
        "created": info.get("created"), "format": info.get("format"), "trigger": info.get("trigger"),
        "machine_verdict": machine.get("verdict"), "host": ident.get("host"), "device": ident.get("device"),
        "run": ident.get("run"),
    }
