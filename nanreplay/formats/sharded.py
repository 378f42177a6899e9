"""The sharded snapshot: one folder for all ranks of a torch.distributed run (see capture/sharded.py).

    nan_step000012_loss_20250101-120000/
        nanreplay.json           what the folder holds (strict JSON, validated here): world size, mesh,
                                 FSDP units, which ranks were non-finite, model and loss facts, and DCP's
                                 storage index ("tensors": per tensor its dtype, shape, chunks, byte ranges)
        rank<r>.json             rank r's batch layout, loss, recorded constants and buffers (by key)
        rank<r>.program.json     rank r's step program (formats/program.py)
        __<r>_0.distcp           torch.distributed.checkpoint data: weight and optimizer shards, and each
                                 rank's batch, buffers and constants under rank<r>/ keys
        .metadata                DCP's own (pickled) index: never read by nanreplay

Loading reads nanreplay.json and the rank files as strict JSON, checks every field, that every key they
name is in the storage index, that the index's chunks tile each tensor, and (before any tensor is read)
every chunk's file and byte range (formats/dcpread.py). Tensors come through DCP's own reader, resharded
to whatever the analysis needs: whole, on one process, or FSDP shards on N ranks. Nothing is unpickled.
"""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch

from nanreplay.enums import Trigger
from nanreplay.errors import LimitError, SnapshotError, UsageError
from nanreplay.formats import schema as S
from nanreplay.formats.base import Format, Snapshot
from nanreplay.formats.native import _AUTOCAST, _ENV, _LOSS_SPEC, _MODEL, program_subject, replay_options
from nanreplay.formats.program import DTYPES, parse_json
from nanreplay.formats.rebuild import parse_device
from nanreplay.inputs import SHARDED_CONTENTS, folder_is_sharded
from nanreplay.limits import format_size
from nanreplay.replay.subject import Subject

FORMAT = "nanreplay.sharded"
RANK_FORMAT = FORMAT + ".rank"
VERSION = 1  # bump on an incompatible change and say why: 1 — the first sharded folder (nanreplay 0.2)
CONTENTS = SHARDED_CONTENTS
MAX_JSON = 256 << 20  # nanreplay.json of a model with 100k tensors on 1000 ranks stays far below this
_KEY = re.compile(r"[^\x00-\x1f]{1,2000}")


def is_snapshot_folder(path: str | Path) -> bool:
    """A folder that holds a sharded snapshot (its nanreplay.json)? (Used by triage to find them.)"""
    try:
        return stat.S_ISREG(os.lstat(Path(path) / CONTENTS).st_mode)
    except OSError:
        return False


def read_json(path: Path, what: str, limit: int = MAX_JSON, why: str = "") -> Any:
    """A JSON file of the folder, strictly parsed: a regular file (no link), bounded size, no NaN tokens,
    no duplicate keys."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SnapshotError(f"{path}: missing ({what}; an incomplete snapshot folder?)") from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise SnapshotError(f"{path}: not a regular file ({what}); links and special files are never read")
    if st.st_size > limit:
        raise LimitError(f"{path}: {format_size(st.st_size)} is more than {format_size(limit)} for {what}{why}")
    try:
        return parse_json(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise SnapshotError(f"{path}: not UTF-8 text ({what})") from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 - parse_json's own error: one line
        raise SnapshotError(f"{path}: not valid JSON ({what}): {e}") from None


def read_folder(path: str | Path, max_memory: int | None = None) -> dict:
    """What `formats.load` hands the formats for a folder: its nanreplay.json (a dict, or refused). Parsed
    JSON takes several times its size in memory: a file over a quarter of `max_memory` is refused."""
    p = Path(path)
    folder_is_sharded(p)
    limit = min(MAX_JSON, max_memory // 4) if max_memory else MAX_JSON
    obj = read_json(p / CONTENTS, "the snapshot's table of contents", limit,
                    " (a quarter of --max-memory: parsed JSON takes several times its size)" if limit < MAX_JSON else "")
    if not isinstance(obj, dict):
        raise SnapshotError(f"{p / CONTENTS}: holds a {type(obj).__name__}, expected an object")
    return obj


# ------------------------------------------------------------------ the schema


def json_number(v: Any, where: str) -> float:
    """A number as the capture side wrote it: plain, or {"f": "nan" | "inf" | "-inf"}."""
    if isinstance(v, dict) and set(v) == {"f"} and v["f"] in ("nan", "inf", "-inf"):
        return float(v["f"])
    return S.number(v, where)


def _shape(v: Any, where: str) -> list[int]:
    return S.list_of(S.integer(0, 2**40), 16)(v, where)


_CHUNK = S.record({"offsets": _shape, "sizes": _shape, "file": S.optional(S.string(200)),
                   "offset": S.integer(0, 2**62), "length": S.integer(0, 2**62),
                   "transforms": S.list_of(S.string(200), 100)}, required=("offsets", "sizes"), extra=False)
_TENSOR = S.record({"dtype": S.one_of(*DTYPES), "shape": _shape, "chunks": S.list_of(_CHUNK, 1_000_000)},
                   required=("dtype", "shape", "chunks"), extra=False)
_NAMES = S.list_of(S.string(1000))
_MESH = S.record({"shape": S.list_of(S.integer(1, 10**7), 8), "dim_names": S.list_of(S.string(100), 8),
                  "device_type": S.string(40), "placements": S.list_of(S.string(100), 8)})

FIELDS: dict[str, S.Checker] = {
    "format": S.string(100), "version": S.integer(1, 1000),
    "created": S.optional(S.string(64)), "nanreplay_version": S.optional(S.string(64)),
    "trigger": S.optional(S.one_of(*[t.value for t in Trigger])),
    "step": S.optional(S.integer()), "micro_batch": S.optional(S.integer(0)),
    "world_size": S.integer(1, 10**6), "nonfinite_ranks": S.optional(S.list_of(S.integer(0, 10**6), 10**6)),
    "strategy": S.one_of("fsdp2", "replicated"), "mesh": S.optional(_MESH),
    "units": _NAMES, "unit_parameters": S.optional(S.dict_of(_NAMES)),
    "parameters": _NAMES, "aliases": S.optional(S.dict_of(S.string(1000))), "buffers": S.optional(_NAMES),
    "model_training": S.optional(S.boolean), "model": S.optional(_MODEL), "loss_spec": S.optional(_LOSS_SPEC),
    "autocast": S.optional(_AUTOCAST), "grad_norm": S.optional(json_number), "spike_median": S.optional(json_number),
    "grad_scale": S.optional(json_number), "optimizer": S.optional(S.dict_of(S.plain_value, limit=64)),
    "environment": S.optional(_ENV), "tensors": S.dict_of(_TENSOR, key=S.string(2000)),
    "notes": S.optional(S.list_of(S.string(2000), 50)),
}
REQUIRED = ("format", "version", "world_size", "strategy", "units", "parameters", "tensors")

_ROW = S.record({"step": S.optional(S.integer()), "micro_batch": S.optional(S.integer()),
                 "loss": S.optional(json_number), "grad_norm": S.optional(json_number), "lr": S.optional(json_number),
                 "scale": S.optional(json_number), "overflow": S.optional(S.boolean),
                 "clip": S.optional(json_number), "base_lr": S.optional(json_number)})
RANK_FIELDS: dict[str, S.Checker] = {
    "format": S.string(100), "rank": S.integer(0, 10**6), "loss_value": S.optional(json_number),
    "micro_batch": S.optional(S.integer(0)), "batch": S.dict_of(lambda v, w: v, limit=3),
    "constants": S.dict_of(S.string(2000)), "buffers": S.dict_of(S.string(2000)),
    "program": S.optional(S.string(100)), "program_error": S.optional(S.string(2000)),
    "history": S.optional(S.list_of(_ROW, 100_000)), "notes": S.optional(S.list_of(S.string(2000), 50)),
}


def tree(v: Any, where: str, keys: set[str], prefix: str, depth: int = 0) -> Any:
    """A batch as rank<r>.json writes it (see capture/sharded.encode_tree), checked: every tensor key in
    the index and under this rank's prefix."""
    if depth > S.MAX_DEPTH:
        raise S.SchemaError(f"{where} is nested too deeply")
    if isinstance(v, dict):
        if set(v) == {"tensor"}:
            k = S.string(2000)(v["tensor"], where)
            if k not in keys or not k.startswith(prefix):
                raise S.SchemaError(f"{where} names tensor {k[:80]!r}, which this rank did not store")
            return v
        if set(v) == {"tuple"}:
            return {"tuple": [tree(x, f"{where}[{i}]", keys, prefix, depth + 1)
                              for i, x in enumerate(S.list_of(lambda x, w: x)(v["tuple"], where))]}
        if set(v) == {"dict"}:
            items = S.list_of(lambda x, w: x)(v["dict"], where)
            out = []
            for i, kv in enumerate(items):
                if not (isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], (str, int))
                        and not isinstance(kv[0], bool)):
                    raise S.SchemaError(f"{where}[{i}] must be a [key, value] pair")
                out.append([kv[0] if isinstance(kv[0], int) else S.string(1000)(kv[0], where),
                            tree(kv[1], f"{where}[{kv[0]!r}]", keys, prefix, depth + 1)])
            return {"dict": out}
        if set(v) == {"f"} or set(v) == {"repr"}:
            return json_number(v, where) if "f" in v else {"repr": S.string(200)(v["repr"], where)}
        raise S.SchemaError(f"{where} holds an object this format does not know")
    if isinstance(v, list):
        return [tree(x, f"{where}[{i}]", keys, prefix, depth + 1) for i, x in enumerate(S.list_of(lambda x, w: x)(v, where))]
    return S.plain_value(v, where, depth)


def build_tree(v: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The batch object from a checked tree and the loaded tensors."""
    if isinstance(v, dict):
        if "tensor" in v:
            return tensors[v["tensor"]]
        if "tuple" in v:
            return tuple(build_tree(x, tensors) for x in v["tuple"])
        if "dict" in v:
            return {k: build_tree(x, tensors) for k, x in v["dict"]}
        return repr(v.get("repr"))
    if isinstance(v, list):
        return [build_tree(x, tensors) for x in v]
    return v


def tree_keys(v: Any) -> list[str]:
    if isinstance(v, dict):
        if "tensor" in v:
            return [v["tensor"]]
        return [k for x in (v.get("tuple") or [kv[1] for kv in v.get("dict") or []]) for k in tree_keys(x)]
    if isinstance(v, list):
        return [k for x in v for k in tree_keys(x)]
    return []


# ------------------------------------------------------------------ the format


def sniff(obj: dict) -> bool:
    return obj.get("format") == FORMAT


def parse(path: str, d: dict) -> Snapshot:
    """Validate the folder (its JSON files, the storage index, the files it names); load no tensor."""
    from nanreplay.formats import dcpread

    folder = Path(path)
    S.format_version(d, path, "sharded snapshot", VERSION)
    try:
        c = S.record(FIELDS, required=REQUIRED)(d, "")
    except S.SchemaError as e:
        raise SnapshotError(f"{path}: damaged sharded snapshot: {e}") from None
    world = c["world_size"]
    bad = [r for r in c.get("nonfinite_ranks") or [] if r >= world]
    if bad:
        raise SnapshotError(f"{path}: damaged sharded snapshot: non-finite rank {bad[0]} of a world of {world}")
    entries = dcpread.entries_of(c["tensors"])
    for key, e in entries.items():
        if any(ch.get("transforms") for ch in c["tensors"][key]["chunks"]):
            raise SnapshotError(f"{path}: {key!r} is stored with DCP storage transforms, which nanreplay does not read")
        dcpread.check_tiling(key, e)
    keys = set(entries)
    params, aliases = c["parameters"], c.get("aliases") or {}
    missing = [n for n in params if f"model/{n}" not in keys]
    if missing:
        raise SnapshotError(f"{path}: damaged sharded snapshot: parameter {missing[0]!r} is not in the checkpoint")
    wrong = [a for a, t in aliases.items() if t not in params or a in params]
    if wrong:
        raise SnapshotError(f"{path}: damaged sharded snapshot: alias {wrong[0]!r} does not name a stored parameter")
    ranks = [_rank_file(folder, r, keys) for r in range(world)]
    nonfinite = c.get("nonfinite_ranks") or []
    first = nonfinite[0] if nonfinite else None
    return Snapshot(path=path, format="sharded", inputs=None, target=None, state=None,
                    keys={"inputs": "inputs", "target": "target"},
                    raw={"contents": c, "ranks": ranks, "entries": entries}, step=c.get("step"), rank=first,
                    world_size=world, trigger=c.get("trigger"), history=list(ranks[first or 0].get("history") or []),
                    created=c.get("created"))


def _rank_file(folder: Path, r: int, keys: set[str]) -> dict:
    name = f"rank{r}.json"
    obj = read_json(folder / name, f"rank {r}'s part")
    try:
        d = S.record(RANK_FIELDS, required=("format", "rank", "batch", "constants", "buffers"))(obj, name)
        if d["format"] != RANK_FORMAT or d["rank"] != r:
            raise S.SchemaError(f"{name} is not rank {r}'s part of a sharded snapshot")
        batch = d["batch"]
        if not set(batch) <= {"inputs", "target", "batch"}:
            raise S.SchemaError(f"{name}.batch has unknown parts")
        d["batch"] = {k: tree(x, f"{name}.batch.{k}", keys, f"rank{r}/") for k, x in batch.items()}
        for what in ("constants", "buffers"):
            for n, k in d[what].items():
                if k not in keys or not k.startswith(f"rank{r}/"):
                    raise S.SchemaError(f"{name}.{what}[{n[:80]!r}] names a tensor this rank did not store")
        if d.get("program") not in (None, f"rank{r}.program.json"):
            raise S.SchemaError(f"{name}.program must be rank{r}.program.json")
    except S.SchemaError as e:
        raise SnapshotError(f"{folder}: damaged sharded snapshot: {e}") from None
    return d


def describe(snap: Snapshot) -> dict:
    c, ranks = snap.raw["contents"], snap.raw["ranks"]
    entries = snap.raw["entries"]
    model = c.get("model") or {}
    mine = ranks[snap.rank or 0]
    missing = [f"rank {d['rank']}: {d.get('program_error') or 'no program'}" for d in ranks if not d.get("program")]
    opt = c.get("optimizer") or {}
    return dict(loss_value=mine.get("loss_value"), grad_norm=c.get("grad_norm"), environment=c.get("environment"),
                program_error="; ".join(missing) or None, export_error="; ".join(missing) or None,
                factory=model.get("factory"), model_class=model.get("class"),
                loss_spec={k: v for k, v in (c.get("loss_spec") or {}).items() if v is not None},
                autocast=c.get("autocast"), grad_scale=c.get("grad_scale"), micro_batch=c.get("micro_batch"),
                nanreplay_version=c.get("nanreplay_version"), format_version=c.get("version"),
                nonfinite_ranks=c.get("nonfinite_ranks"), spike_median=c.get("spike_median"),
                notes=list(c.get("notes") or []),
                sharded={"world_size": c["world_size"], "strategy": c["strategy"], "mesh": c.get("mesh"),
                         "units": c["units"], "optimizer": opt.get("class"),
                         "optimizer_tensors": sum(k.startswith("optim/") for k in entries),
                         "checkpoint_bytes": sum(e.nbytes for e in entries.values()),
                         "ranks": [{"rank": d["rank"], "loss_value": d.get("loss_value"),
                                    "program": bool(d.get("program")), "program_error": d.get("program_error")}
                                   for d in ranks]})


# ------------------------------------------------------------------ rebuilding: whole, on one process


def rank_state_keys(snap: Snapshot, r: int) -> list[str]:
    d = snap.raw["ranks"][r]
    return [k for part in d["batch"].values() for k in tree_keys(part)] + list(d["constants"].values()) + \
        list(d["buffers"].values())


def load_whole(snap: Snapshot, keys: list[str], device: torch.device, max_memory: int | None) -> dict[str, torch.Tensor]:
    """The tensors under `keys`, whole (DCP reshards every saved shard into one tensor), on `device`."""
    from nanreplay.formats import dcpread

    entries = snap.raw["entries"]
    need = sum(entries[k].nbytes for k in keys)
    if max_memory is not None and need > max_memory:
        raise LimitError(f"{snap.path}: the weights and batches to replay on one process take {format_size(need)}, "
                         f"more than --max-memory {format_size(max_memory)}; analyze on several ranks with --nproc N, "
                         "or raise the limit")
    targets = {k: torch.empty(entries[k].shape, dtype=entries[k].dtype) for k in keys}
    dcpread.load(snap.path, entries, targets, max_memory=max_memory)
    return {k: t.to(device) for k, t in targets.items()}


def rank_subject(snap: Snapshot, r: int, tensors: dict[str, torch.Tensor], dev: torch.device,
                 max_memory: int | None) -> Subject:
    """Rank r's step as its program, from loaded tensors (the weights shared with every other rank's)."""
    c, d = snap.raw["contents"], snap.raw["ranks"][r]
    if not d.get("program"):
        raise SnapshotError(f"{snap.path}: rank {r} holds no step program ({d.get('program_error') or 'not recorded'})")
    text = read_json_text(Path(snap.path) / d["program"])
    state = {n: tensors[f"model/{n}"] for n in c["parameters"]}
    state.update({n: tensors[k] for n, k in d["buffers"].items()})
    batch = {k: build_tree(v, tensors) for k, v in d["batch"].items()}
    raw = {"step_program": text, "constants": {n: tensors[k] for n, k in d["constants"].items()}, "batch": batch,
           "parameters": list(c["parameters"]), "aliases": c.get("aliases") or {},
           "model_training": c.get("model_training", True), "model": c.get("model"), "loss_spec": c.get("loss_spec")}
    inputs, target = (batch["batch"], None) if "batch" in batch else (batch.get("inputs"), batch.get("target"))
    part = Snapshot(path=f"{snap.path} (rank {r})", format="sharded", inputs=inputs, target=target, state=state, raw=raw)
    opts = replay_options({"autocast": c.get("autocast"), "grad_scale": c.get("grad_scale")}, dev)
    subject = program_subject(part, dev, max_memory, opts)
    subject.how = f"rank {r}'s step program in the sharded snapshot (no training code needed)"
    return subject


def read_json_text(path: Path) -> str:
    """A program file's text (parsed and validated later by formats/program.decode)."""
    read_json(path, "a step program")  # regular file, size, strict JSON
    return path.read_text(encoding="utf-8")


def rebuild(snap: Snapshot, *, model: str | None, loss: str | None, device: str | None, trust: bool,
            max_memory: int | None = None, rank: int | None = None) -> Subject:
    """One rank's step on one process (the first non-finite rank unless `rank` says)."""
    if model is not None or loss is not None:
        raise UsageError(f"{snap.path}: a sharded snapshot replays the step programs its ranks recorded; "
                         "--model and --loss do not apply to it")
    r = (snap.rank or 0) if rank is None else rank
    dev = parse_device(device)
    keys = [f"model/{n}" for n in snap.raw["contents"]["parameters"]] + rank_state_keys(snap, r)
    return rank_subject(snap, r, load_whole(snap, keys, dev, max_memory), dev, max_memory)


def replay_bytes(snap: Snapshot) -> int:
    """The weights alone, whole: what one process must hold before any replay."""
    entries = snap.raw["entries"]
    return sum(entries[f"model/{n}"].nbytes for n in snap.raw["contents"]["parameters"])


def numel_of(contents: dict, key: str) -> int:
    return math.prod(contents["tensors"][key]["shape"])


def fsdp_rows(shape: list[int], world: int) -> list[tuple[int, int]]:
    """Rows [lo, hi) of dim 0 each rank's FSDP2 shard holds (torch.chunk: ceil(n / world) rows each)."""
    n = shape[0] if shape else 1
    size = math.ceil(n / world) if n else 0
    return [(min(n, r * size), min(n, (r + 1) * size)) for r in range(world)]


SHARDED = Format("sharded", "sharded snapshot", sniff, parse, rebuild, describe)
