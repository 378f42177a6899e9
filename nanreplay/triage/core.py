"""`nanreplay triage DIR`: every snapshot in a folder, analyzed in parallel, grouped by root cause.

A pipeline of plain functions that the CLI calls in turn:

    plan()     find the snapshot files, hash them, reuse cached results, name the outputs
    analyze()  analyze the rest in a WorkerPool; each worker writes <name>.html and <name>.json
    write()    group the rows; write groups.json, summary.csv, index.html and the cache

A snapshot that cannot be analyzed (unreadable, hostile, no model for it, a replay that
raises or hangs) becomes a failed row with a one-line reason; it never stops the run.
Input files are only ever read: everything is written inside OUTDIR, which may not be DIR.

This module stays light to import (no torch, pandas or jinja2 at the top): the parent
process never needs torch, and the workers import it once, not per snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

from nanreplay import __version__, atomic
from nanreplay.errors import NanReplayError, PoolError, ReplayError, SnapshotError, TrustError, UsageError
from nanreplay.triage.workpool import Outcome, PoolStats, WorkerPool

SCHEMA = "nanreplay.triage/1"  # groups.json
# The result cache kept in OUTDIR. Bump CACHE_SCHEMA on any incompatible change and say why here.
#   1 — first version.
CACHE_SCHEMA = "nanreplay.triage-cache/1"
CACHE_FILE = ".nanreplay-cache.json"  # a leading dot: no snapshot's output name can start with one
SNAPSHOT_SUFFIXES = (".pt", ".pth", ".ckpt", ".pkl", ".pickle")
RESERVED_NAMES = frozenset({"index", "groups", "summary"})  # OUTDIR's own files
DEFAULT_TIMEOUT = 600.0

# Why a snapshot failed -> how the summary and the index say it.
FAILURES = {
    "unreadable": "unreadable",  # missing bytes, corrupt, truncated, not a snapshot
    "refused": "refused",  # would run code from the file; needs --trust
    "not_replayable": "not replayable",  # no or wrong model, loss, state that does not fit
    "replay_error": "replay failed",  # the model raised during replay
    "timeout": "timed out",
    "crashed": "crashed",  # the worker died (segfault, out of memory)
    "output_error": "output not written",
    "internal_error": "internal error",  # a bug in nanreplay: the reason says what
}
RETRY = frozenset({"timeout", "crashed", "internal_error", "output_error"})  # never cached: may pass next time

# Modules a worker needs, imported once: by the fork server (each worker is then a cheap
# fork) or, without one, by each worker at start. torch._dynamo is what the first replay
# would otherwise import lazily (it is behind TorchDispatchMode): about 1.5 s.
WORKER_PRELOAD = ("torch", "torch._dynamo", "jinja2", "nanreplay.analysis", "nanreplay.diagnose",
                  "nanreplay.verify", "nanreplay.report.html", "nanreplay.triage")

COLUMNS = ["file", "name", "status", "group", "verdict", "cause", "title", "op", "forward_op", "backward_node",
           "phase", "kind", "module", "source", "source_path", "source_line", "code", "fix_kind", "fix_code",
           "fix_verified", "step", "rank", "world_size", "created", "format", "trigger", "failure", "reason",
           "duplicate_of", "cached", "seconds", "write_seconds", "sha256", "report", "json"]


@dataclass(frozen=True)
class Options:
    """The options that change what an analysis says: part of every cache key."""

    model: str | None = None
    loss: str | None = None
    trust: bool = False
    device: str | None = None
    verify: bool = True

    def fingerprint(self) -> dict:
        return {"model": self.model, "loss": self.loss, "trust": self.trust, "device": self.device,
                "verify": self.verify, "nanreplay": __version__, "torch": _torch_version()}


@dataclass
class Item:
    """One snapshot file and, once known, its row of results."""

    path: str  # DIR/rel, as the user spelled DIR: what the reports show
    rel: str  # relative to DIR, '/'-separated
    name: str = ""  # output stem in OUTDIR: <name>.html, <name>.json
    size: int = 0
    mtime_ns: int = 0
    sha256: str | None = None
    key: str | None = None  # content hash + nanreplay version + options
    duplicate_of: str = ""  # the first file (in name order) with the same bytes
    row: dict | None = None


@dataclass
class Plan:
    dir: Path
    outdir: Path
    options: Options
    items: list[Item]
    ignored: list[str]  # files in DIR that are not snapshots by name
    old_cache: dict[str, dict]  # rel -> entry, as the last run left it
    use_cache: bool = True
    stats: PoolStats | None = None

    @property
    def todo(self) -> list[Item]:
        return [it for it in self.items if it.row is None]


@dataclass
class Result:
    rows: list[dict]
    groups: list[dict]
    failures: list[dict]
    ranks: dict | None
    summary: str  # the one line
    index: Path
    counts: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0


# ================================================================== plan


def default_outdir(directory: str) -> str:
    """`./<DIR's name>.nanreplay`, next to where the command runs (like analyze's reports)."""
    return f"{Path(directory).resolve().name or 'snapshots'}.nanreplay"


def plan(directory: str, outdir: str, *, options: Options, recursive: bool = False, use_cache: bool = True) -> Plan:
    """Validate DIR and OUTDIR, find the snapshots and reuse what the cache already knows."""
    d, out = Path(directory), Path(outdir)
    for opt, spec in (("--model", options.model), ("--loss", options.loss)):
        # Only the spelling is checked here: importing user code is the workers' job.
        if spec and (":" in spec or opt == "--model") and not _SPEC.fullmatch(spec):
            raise UsageError(f"{opt} {spec!r}: expected MODULE:NAME, e.g. mypkg.models:build")
    if not d.exists():
        raise UsageError(f"{directory}: no such folder")
    if not d.is_dir():
        raise UsageError(f"{directory}: not a folder (use `nanreplay analyze` for a single snapshot)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{outdir}: exists and is not a folder")
    if out.resolve() == d.resolve():
        raise UsageError(f"{outdir}: the output folder must not be DIR itself (triage never writes among the inputs)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{outdir}: cannot create the output folder: {e.strerror or e}") from None
    if not os.access(out, os.W_OK):
        raise UsageError(f"{outdir}: the output folder is not writable")

    rels, ignored = discover(d, out, recursive=recursive)
    items = [Item(path=str(d / rel), rel=rel) for rel in rels]
    assign_names(items)
    old = load_cache(out)
    fp = options.fingerprint()
    first_of: dict[str, str] = {}
    for it in items:
        _fingerprint(it, old.get(it.rel), fp)
        if it.sha256 is None:
            continue
        dup = first_of.setdefault(it.sha256, it.rel)
        it.duplicate_of = dup if dup != it.rel else ""
        entry = old.get(it.rel)
        if use_cache and entry and entry.get("key") == it.key and entry.get("name") == it.name \
                and _outputs_exist(out, entry["row"]):
            it.row = _row(it, dict(entry["row"]), cached=True)
    return Plan(dir=d, outdir=out, options=options, items=items, ignored=ignored, old_cache=old, use_cache=use_cache)


def discover(d: Path, out: Path, *, recursive: bool) -> tuple[list[str], list[str]]:
    """Snapshot files (by suffix) and the other files, relative to d; hidden files and OUTDIR skipped."""
    out_r = out.resolve()
    snaps: list[str] = []
    other: list[str] = []
    for root, dirs, files in os.walk(d):
        rootp = Path(root)
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and (rootp / x).resolve() != out_r) if recursive else []
        for f in sorted(files):
            p = rootp / f
            if f.startswith(".") or not p.is_file():
                continue
            rel = p.relative_to(d).as_posix()
            (snaps if p.suffix.lower() in SNAPSHOT_SUFFIXES else other).append(rel)
    return snaps, other


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def _base_name(rel: str) -> str:
    p = PurePosixPath(rel)
    parts = [*p.parent.parts, p.stem] if str(p.parent) != "." else [p.stem]
    name = "__".join(_UNSAFE.sub("_", s) for s in parts).strip(".")
    return name[:100] or "snapshot"


def assign_names(items: list[Item]) -> None:
    """A distinct output name per snapshot, stable across runs; never one of OUTDIR's own files.

    `a/x.pt` -> `a__x`; when two files would share a name (`x.pt` and `x.pth`, or names
    that differ only in case or in characters that are not safe in a file name), each
    gets a short hash of its path: `x-3f2a9c1b`.
    """
    base = {it.rel: _base_name(it.rel) for it in items}
    counts = Counter(n.casefold() for n in base.values())
    seen: set[str] = set()
    for it in items:
        n = base[it.rel]
        if counts[n.casefold()] > 1 or n.casefold() in RESERVED_NAMES:
            n = f"{n}-{hashlib.sha1(it.rel.encode()).hexdigest()[:8]}"
        unique, k = n, 2
        while unique.casefold() in seen:  # a hashed name that happens to equal a plain one
            unique, k = f"{n}-{k}", k + 1
        seen.add(unique.casefold())
        it.name = unique


def _fingerprint(it: Item, entry: dict | None, fp: dict) -> None:
    """Content hash (reused when size and mtime match the last run) and cache key; a read error is a row."""
    try:
        st = os.stat(it.path)
        it.size, it.mtime_ns = st.st_size, st.st_mtime_ns
        if entry and entry.get("size") == it.size and entry.get("mtime_ns") == it.mtime_ns and entry.get("sha256"):
            it.sha256 = entry["sha256"]
        else:
            it.sha256 = _sha256(it.path)
    except OSError as e:
        it.row = _row(it, _failed("unreadable", f"cannot read: {e.strerror or e}"))
        return
    it.key = hashlib.sha256(json.dumps({"sha256": it.sha256, **fp}, sort_keys=True).encode()).hexdigest()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _outputs_exist(out: Path, row: dict) -> bool:
    return all((out / row[k]).is_file() for k in ("report", "json") if row.get(k))


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:  # pragma: no cover
        return "unknown"


# ================================================================== analyze (parent side)


def analyze(p: Plan, *, jobs: int, timeout: float | None = DEFAULT_TIMEOUT, progress=None,
            threads: int | None = None) -> PoolStats | None:
    """Analyze every snapshot the cache could not answer, in up to `jobs` worker processes.

    Each worker gets `threads` torch threads [default: the CPUs shared out among the
    workers]. `progress(n)` is called as snapshots finish. The cache is saved as results come in
    (and on the way out, even on Ctrl-C), so an interrupted run loses little.
    """
    todo = p.todo
    if not todo:
        return None
    by_name = {it.name: it for it in todo}
    tasks = [{"path": it.path, "name": it.name, "outdir": str(p.outdir), "model": p.options.model,
              "loss": p.options.loss, "trust": p.options.trust, "device": p.options.device,
              "verify": p.options.verify} for it in todo]
    workers = min(jobs, len(todo))
    threads = threads or max(1, _cpu_count() // workers)
    pool = WorkerPool(analyze_task, jobs=workers, timeout=timeout, init=worker_init, init_args=(threads,),
                      preload=WORKER_PRELOAD)
    saved = time.monotonic()
    try:
        for task, outcome in pool.map(tasks):
            it = by_name[task["name"]]
            it.row = _row(it, _fields_of(outcome))
            if outcome.status in ("timeout", "crashed"):
                _remove_debris(p.outdir, it.name)
            if progress is not None:
                progress(1)
            if time.monotonic() - saved > 10:
                save_cache(p)
                saved = time.monotonic()
    except PoolError as e:
        raise PoolError(f"cannot run the analysis workers: {e}") from None
    finally:
        save_cache(p)
    p.stats = pool.stats
    return pool.stats


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


def default_jobs() -> int:
    return _cpu_count()


def _fields_of(outcome: Outcome) -> dict:
    if outcome.status == "ok":
        return outcome.value
    if outcome.status == "error":
        return _failed("internal_error", f"nanreplay bug, please report: {outcome.error}", detail=outcome.detail)
    return _failed(outcome.status, outcome.error)


def _remove_debris(out: Path, name: str) -> None:
    """A killed worker may leave an atomic write's temp file behind (`.<name>.html.XXXX.tmp`)."""
    for suffix in ("html", "json"):
        for tmp in out.glob(f".{glob_escape(name)}.{suffix}.*.tmp"):
            tmp.unlink(missing_ok=True)


def glob_escape(s: str) -> str:
    return re.sub(r"([*?[])", r"[\1]", s)


# ================================================================== analyze (worker side)


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
    """Worker side: analyze one snapshot, write its report and JSON, return its row's fields."""
    from nanreplay.analysis import analyze as analyze_one
    from nanreplay.report.html import write_report

    t0 = time.perf_counter()
    try:
        a = analyze_one(task["path"], model=task["model"], loss=task["loss"], trust=task["trust"],
                        device=task.get("device"), verify=task.get("verify", True))
    except NanReplayError as e:
        return _failed(_category(e), str(e), path=task["path"])
    seconds = time.perf_counter() - t0
    out = Path(task["outdir"])
    report, js = f"{task['name']}.html", f"{task['name']}.json"
    d = a.to_json()
    try:
        atomic.write_text(out / js, json.dumps(d, indent=2, allow_nan=False))
        write_report(a, str(out / report))
    except (OSError, NanReplayError) as e:
        for f in (report, js):
            (out / f).unlink(missing_ok=True)
        return _failed("output_error", str(e))
    fields = analysis_fields(d)
    fields.update(seconds=round(seconds, 4), write_seconds=round(time.perf_counter() - t0 - seconds, 4),
                  report=report, json=js)
    return fields


def _category(e: NanReplayError) -> str:
    if isinstance(e, TrustError):
        return "refused"
    if isinstance(e, ReplayError):
        return "replay_error"
    if isinstance(e, SnapshotError):
        return "unreadable"
    return "not_replayable"


def analysis_fields(d: dict) -> dict:
    """The summary-row fields of one analysis (its contract JSON)."""
    c = d.get("culprit") or {}
    diag = d.get("diagnosis") or {}
    fix = diag.get("fix") or {}
    src = c.get("source") or {}
    info = d.get("snapshot_info") or {}
    code = fix.get("after") or fix.get("code") or ""
    return {
        "status": "analyzed", "verdict": d.get("verdict"), "cause": diag.get("cause"), "title": diag.get("title"),
        "op": c.get("op"), "forward_op": c.get("forward_op"), "backward_node": c.get("backward_node"),
        "phase": c.get("phase"), "kind": c.get("kind"), "module": c.get("module"),
        "source": f"{src['file']}:{src['line']}" if src.get("file") else None,
        "source_path": src.get("path") or src.get("file"), "source_line": src.get("line"), "code": src.get("code"),
        "fix_kind": fix.get("kind"), "fix_code": code, "fix_verified": fix.get("verified"),
        "step": info.get("step"), "rank": info.get("rank"), "world_size": info.get("world_size"),
        "created": info.get("created"), "format": info.get("format"), "trigger": info.get("trigger"),
    }


def _failed(category: str, reason: str, *, path: str | None = None, detail: str = "") -> dict:
    reason = " ".join(reason.split())
    if path and reason.startswith(f"{path}: "):  # the row already names the file
        reason = reason[len(path) + 2:]
    return {"status": "failed", "failure": category, "reason": reason, "detail": detail}


def _row(it: Item, fields: dict, *, cached: bool = False) -> dict:
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(fields)
    row.update(file=it.rel, name=it.name, sha256=it.sha256, duplicate_of=it.duplicate_of, cached=cached)
    row["group"] = group_id(signature(row)) if row["status"] == "analyzed" else None
    return row


# ================================================================== grouping


def signature(row: dict) -> tuple:
    """What makes two snapshots the same bug: verdict, cause, forward op, module, source line."""
    return (row.get("verdict"), row.get("cause"), row.get("forward_op"), row.get("module"),
            row.get("source_path"), row.get("source_line"))


def group_id(sig: tuple) -> str:
    return "g" + hashlib.sha1(json.dumps(sig).encode()).hexdigest()[:10]


def build_groups(rows: list[dict]) -> list[dict]:
    """Analyzed rows grouped by signature, largest group first (then earliest step)."""
    by_id: dict[str, list[dict]] = {}
    for r in rows:
        if r["status"] == "analyzed":
            by_id.setdefault(r["group"], []).append(r)
    groups = []
    for gid, members in by_id.items():
        first = members[0]
        steps = [m["step"] for m in members if isinstance(m.get("step"), int)]
        verified = [m["fix_verified"] for m in members]
        groups.append({
            "id": gid, "count": len(members),
            "verdict": first["verdict"], "cause": first["cause"], "title": first["title"],
            "op": first["op"], "forward_op": first["forward_op"], "backward_node": first["backward_node"],
            "phase": first["phase"], "kind": first["kind"], "module": first["module"],
            "source": {"file": first["source"], "path": first["source_path"], "line": first["source_line"],
                       "code": first["code"]} if first["source"] else None,
            "first_step": min(steps) if steps else None, "last_step": max(steps) if steps else None,
            "ranks": sorted({m["rank"] for m in members if isinstance(m.get("rank"), int)}),
            "fix": {"kind": first["fix_kind"], "code": first["fix_code"],
                    "verified": sum(v is True for v in verified), "not_verified": sum(v is False for v in verified),
                    "of": len(members)},
            "snapshots": [{"file": m["file"], "report": m["report"], "json": m["json"], "step": m["step"],
                           "rank": m["rank"], "duplicate_of": m.get("duplicate_of") or None} for m in members],
        })
    inf = float("inf")
    groups.sort(key=lambda g: (-g["count"], g["first_step"] if g["first_step"] is not None else inf, g["id"]))
    return groups


def _when(created: str | None):
    if not created:
        return None
    try:
        t = datetime.fromisoformat(str(created).replace("Z", "+00:00"))
        return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def build_ranks(rows: list[dict]) -> dict | None:
    """Per step, which rank failed first and whether the ranks agree on the culprit.

    Only snapshots that carry both a step and a rank take part. Within a step, ranks are
    ordered by the time the snapshot was written, where every snapshot of that step has one.
    """
    ranked = [r for r in rows if isinstance(r.get("step"), int) and isinstance(r.get("rank"), int)]
    if not ranked:
        return None
    steps = []
    for step in sorted({r["step"] for r in ranked}):
        at = sorted((r for r in ranked if r["step"] == step), key=lambda r: r["rank"])
        times = [_when(r.get("created")) for r in at]
        first, by = None, None
        if len(at) == 1:
            first, by = at[0], "only rank"
        elif all(times):
            first, by = min(zip(times, at, strict=True), key=lambda x: x[0])[1], "written first"
        groups = {r["group"] for r in at if r["status"] == "analyzed"}
        failed = [r["rank"] for r in at if r["status"] != "analyzed"]
        agree = None if failed or len(at) < 2 else len(groups) == 1
        steps.append({"step": step, "ranks": [r["rank"] for r in at], "first_rank": first["rank"] if first else None,
                      "first_file": first["file"] if first else None, "ordered_by": by,
                      "agree": agree, "groups": sorted(g for g in groups if g), "failed_ranks": failed,
                      "entries": [{"rank": r["rank"], "file": r["file"], "group": r["group"], "report": r["report"],
                                   "created": r.get("created"), "status": r["status"]} for r in at]})
    earliest = steps[0]
    return {"steps": steps, "first": {"step": earliest["step"], "rank": earliest["first_rank"],
                                      "file": earliest["first_file"], "ranks": earliest["ranks"]},
            "world_size": max((r["world_size"] for r in ranked if isinstance(r.get("world_size"), int)), default=None)}


# ================================================================== outputs


def write(p: Plan) -> Result:
    """Group the rows and write groups.json, summary.csv and index.html (all atomically)."""
    rows = [it.row for it in p.items if it.row is not None]
    groups = build_groups(rows)
    failures = [{"file": r["file"], "failure": r["failure"], "label": FAILURES.get(r["failure"], r["failure"]),
                 "reason": r["reason"], **({"detail": r["detail"]} if r.get("detail") else {})}
                for r in rows if r["status"] != "analyzed"]
    ranks = build_ranks(rows)
    counts = {"snapshots": len(rows), "analyzed": len(rows) - len(failures), "failed": len(failures),
              "cached": sum(bool(r["cached"]) for r in rows), "groups": len(groups), "ignored": len(p.ignored),
              "failures": dict(Counter(f["failure"] for f in failures))}
    summary = summary_line(counts, groups)
    _remove_stale_outputs(p)
    p.old_cache = {}  # cleaned up: the cache now holds only what this run has
    save_cache(p)
    doc = {"schema": SCHEMA, "nanreplay_version": __version__, "dir": str(p.dir),
           "options": {"model": p.options.model, "loss": p.options.loss, "trust": p.options.trust},
           "summary": summary, "counts": counts, "groups": groups, "failures": failures, "ranks": ranks,
           "ignored": p.ignored}
    try:
        atomic.write_text(p.outdir / "groups.json", json.dumps(doc, indent=2, allow_nan=False))
        atomic.write_text(p.outdir / "summary.csv", summary_csv(rows))
        atomic.write_text(p.outdir / "index.html", render_index(doc))
    except OSError as e:
        raise UsageError(f"{p.outdir}: cannot write the triage outputs: {e.strerror or e}") from None
    return Result(rows=rows, groups=groups, failures=failures, ranks=ranks, summary=summary,
                  index=p.outdir / "index.html", counts=counts)


def summary_line(counts: dict, groups: list[dict]) -> str:
    causes = sum(g["verdict"] != "not_reproduced" for g in groups)
    parts = [_plural(counts["snapshots"], "snapshot"), _plural(causes, "root cause")]
    not_repro = sum(g["count"] for g in groups if g["verdict"] == "not_reproduced")
    if not_repro:
        parts.append(f"{not_repro} not reproduced")
    parts += [f"{n} {FAILURES.get(cat, cat)}" for cat, n in sorted(counts["failures"].items())]
    line = ", ".join(parts)
    if counts["cached"]:
        line += f" ({counts['cached']} from cache)"
    if counts["ignored"]:
        line += f"; {_plural(counts['ignored'], 'other file')} ignored"
    return line


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def summary_csv(rows: list[dict]) -> str:
    import pandas as pd

    df = pd.DataFrame(rows, columns=COLUMNS)
    for col in ("step", "rank", "world_size", "source_line"):  # integers with gaps: not 12.0
        df[col] = df[col].astype("Int64")
    # A cell a spreadsheet would read as a formula (=, +, -, @) is quoted: file names and code come
    # from the snapshots, and a CSV must not run anything when opened.
    for col in df.columns:
        if not (pd.api.types.is_numeric_dtype(df[col]) or pd.api.types.is_bool_dtype(df[col])):
            df[col] = df[col].map(lambda v: "'" + v if isinstance(v, str) and v[:1] in "=+-@\t\r" and v else v)
    return df.to_csv(index=False)


def _remove_stale_outputs(p: Plan) -> None:
    """Delete reports this tool wrote earlier that no current snapshot owns (only ever in OUTDIR)."""
    live = {it.name for it in p.items if it.row is not None and it.row["status"] == "analyzed"}
    for entry in p.old_cache.values():
        name = entry.get("name")
        if not name or name in live or "/" in name or name.startswith("."):
            continue
        for suffix in ("html", "json"):
            (p.outdir / f"{name}.{suffix}").unlink(missing_ok=True)


# ================================================================== the cache


def load_cache(out: Path) -> dict[str, dict]:
    """rel -> entry from the last run; an unreadable or other-version cache counts as empty."""
    try:
        doc = json.loads((out / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("schema") != CACHE_SCHEMA or not isinstance(doc.get("entries"), dict):
        return {}
    return {k: v for k, v in doc["entries"].items() if isinstance(v, dict) and isinstance(v.get("row"), dict)}


def save_cache(p: Plan) -> None:
    # Entries of files that are gone stay until write() has removed their reports.
    current = {it.rel for it in p.items}
    entries = {rel: e for rel, e in p.old_cache.items() if rel not in current}
    for it in p.items:
        if it.row is None or it.key is None or it.row.get("failure") in RETRY:
            continue
        row = {k: v for k, v in it.row.items() if k not in ("cached", "duplicate_of")}
        entries[it.rel] = {"key": it.key, "sha256": it.sha256, "size": it.size, "mtime_ns": it.mtime_ns,
                           "name": it.name, "row": row}
    doc = {"schema": CACHE_SCHEMA, "nanreplay_version": __version__, "entries": entries}
    try:
        atomic.write_text(p.outdir / CACHE_FILE, json.dumps(doc, allow_nan=False))
    except OSError:
        pass  # a cache that cannot be written costs time next run, not results


# ================================================================== index.html


def _steps(first: int | None, last: int | None) -> str:
    if first is None:
        return "—"
    return str(first) if first == last else f"{first}–{last}"


def _module(m: str | None) -> str:
    if m is None:
        return "—"
    return m or "<root>"


def index_view(doc: dict) -> dict:
    """Everything index.html shows, as plain data; the template only lays it out."""
    groups = []
    for g in doc["groups"]:
        fix = g["fix"]
        groups.append({**g, "steps": _steps(g["first_step"], g["last_step"]),
                       "module_label": _module(g["module"]),
                       "ranks_label": ", ".join(map(str, g["ranks"])) or "—",
                       "verified_label": f"verified by replay in {fix['verified']} of {fix['of']}" if fix["verified"]
                       else ("not verified" if fix["not_verified"] else "not verifiable"),
                       "show_fix": bool(fix["kind"] and fix["kind"] != "none" and fix["code"])})
    titles = {g["id"]: g["title"] or g["cause"] or g["verdict"] for g in doc["groups"]}
    numbers = {g["id"]: i for i, g in enumerate(doc["groups"], 1)}
    return {"title": f"nanreplay triage: {doc['dir']}", "doc": doc, "groups": groups, "titles": titles,
            "numbers": numbers, "failures": doc["failures"], "ranks": doc["ranks"], "ignored": doc["ignored"],
            "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def render_index(doc: dict) -> str:
    from nanreplay.report.html import jinja_env

    return jinja_env().get_template("triage.html.j2").render(**index_view(doc))
