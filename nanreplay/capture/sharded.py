"""Sharded snapshots: every rank of a torch.distributed run writes its part of ONE snapshot folder.

    guard = NanGuard(fsdp_model, optimizer, loss_fn=F.cross_entropy, sync_ranks=True)

A model whose parameters are DTensors (FSDP2 `fully_shard`) gets a folder snapshot; so does any model
under torch.distributed with `NanGuard(..., sharded=True)` (DDP). On a failure — every rank stops at
the same check, because `sync_ranks=True` makes them agree — each rank:

1. records its own step as a step program. Under FSDP2 the forward runs once more with FSDP's hooks
   as in a recomputation (`torch_internals.fsdp_recompute_state`) while nanreplay gathers each unit's
   parameters just before the unit's call and frees them after it (`FSDPModule.unshard()`/`reshard()`,
   unseen by the recorder). The program therefore names the FULL parameters ("layers.0.fc.weight",
   [out, in]) and holds no collective: it replays on one process or on N;
2. writes `rank<r>.json` (its batch layout, loss, constants, buffers) and `rank<r>.program.json`;
3. joins one `torch.distributed.checkpoint` save of its shard of the weights and the optimizer state and
   of its own batch, buffers and recorded constants (under `rank<r>/` keys).

Rank 0 writes `nanreplay.json` last: the folder's table of contents (world size, mesh, FSDP units, which
ranks were non-finite, and DCP's storage index as plain data, so that loading never needs DCP's pickled
`.metadata`). A folder without it is incomplete. This module imports only torch.
"""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from nanreplay import __version__, atomic
from nanreplay import torch_internals as ti
from nanreplay.capture import snapshot
from nanreplay.capture.program import ModuleHooks
from nanreplay.errors import GuardError, first_line
from nanreplay.formats.loss_spec import loss_spec
from nanreplay.formats.program import encode_float

FORMAT = "nanreplay.sharded"
VERSION = 1
CONTENTS = "nanreplay.json"  # written last, by rank 0: its presence marks a complete folder


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without torch.distributed
        return False
    return isinstance(t, DTensor)


def is_sharded(model: nn.Module) -> bool:
    """Are the model's parameters DTensors (FSDP2 `fully_shard`, or DTensor-based parallelism)?"""
    return any(is_dtensor(p) for p in model.parameters())


def wanted(model: nn.Module, option: bool | None) -> bool:
    """Does this guard write a folder snapshot? (`option` is NanGuard's `sharded=`.)"""
    dist = torch.distributed
    if option is False or not (dist.is_available() and dist.is_initialized()):
        return False
    return bool(option) or is_sharded(model)


def fsdp_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every FSDP2 unit (a module `fully_shard` was applied to), root first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]


def unit_parameters(model: nn.Module, units: list[tuple[str, nn.Module]]) -> dict[str, list[str]]:
    """Which parameters each FSDP2 unit manages: those below it and not below a nested unit."""
    ids = {id(m) for _, m in units}
    order = {id(p): (i, n) for i, (n, p) in enumerate(model.named_parameters())}
    out = {}
    for name, unit in units:
        todo, mine = [unit], []
        while todo:
            m = todo.pop()
            mine += [order[id(p)] for p in m.parameters(recurse=False) if id(p) in order]
            todo.extend(c for c in m.children() if id(c) not in ids)
        out[name] = [n for _, n in sorted(mine)]
    return out


# ------------------------------------------------------------------ recording under FSDP2


class _UnitGather:
    """Gathers an FSDP2 unit's parameters just before its call while a step is recorded, frees them after."""

    def __init__(self, model: nn.Module, units: list[tuple[str, nn.Module]]):
        self.model = model
        self.units = {id(m): m for _, m in units}
        self.gathered: list[nn.Module] = []

    def _holds_shards(self, unit: nn.Module) -> bool:
        todo = [unit]
        while todo:
            m = todo.pop()
            if any(is_dtensor(p) for p in m.parameters(recurse=False)):
                return True
            todo.extend(c for c in m.children() if id(c) not in self.units)
        return False

    def before(self, mod: nn.Module) -> dict | None:
        if id(mod) not in self.units:
            return None
        if self._holds_shards(mod):  # (the root may still be gathered from the training forward: leave it so)
            mod.unshard()
            self.gathered.append(mod)
        # the gathered parameters are the tensors the unit's ops read: leaves, under their own names
        return {id(p): ("param", n, None) for n, p in self.model.named_parameters() if not is_dtensor(p)}

    def after(self, mod: nn.Module) -> None:
        for i in range(len(self.gathered) - 1, -1, -1):
            if self.gathered[i] is mod:
                self.gathered.pop(i).reshard()
                return

    def release(self) -> None:
        while self.gathered:
            self.gathered.pop().reshard()


def record(model: nn.Module, state: snapshot.StepState, forward, loss, autocast: dict | None):
    """`snapshot.record` for a model under torch.distributed: (program or None, constants, why not, seconds).

    Under FSDP2 every rank must call this at the same time (gathering a unit's parameters is a collective).
    """
    units = fsdp_units(model)
    other = _not_fsdp(model)
    if other:
        return None, {}, (f"parameter {other} is a DTensor placed other than FSDP2 places it (tensor "
                          "parallelism): its forward runs collectives a step program cannot hold yet"), 0.0
    if not units:
        return snapshot.record(model, state, forward, loss, autocast)
    gather = _UnitGather(model, units)
    try:
        with ti.fsdp_recompute_state([m for _, m in units]):
            return snapshot.record(model, state, forward, loss, autocast, ModuleHooks(gather.before, gather.after))
    except ti.FsdpInternalsError as e:
        return None, {}, str(e), 0.0
    finally:
        gather.release()


def _not_fsdp(model: nn.Module) -> str | None:
    """The first DTensor parameter that FSDP2 (or HSDP) did not place: a name, or None."""
    for name, p in model.named_parameters():
        if is_dtensor(p) and not all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in p.placements):
            return f"{name!r} ({', '.join(map(str, p.placements))})"
    if not fsdp_units(model) and is_sharded(model):
        return next(repr(n) for n, p in model.named_parameters() if is_dtensor(p))
    return None


# ------------------------------------------------------------------ writing the folder


def write(guard: Any, trigger: str, extra: dict) -> str:
    """Every rank's part of one snapshot folder; returns the folder's path (the same on every rank).

    Collective: every rank of the default process group must call it for the same failure, which
    `sync_ranks=True` guarantees. A rank that fails before the checkpoint makes every rank give up
    (one flag all-reduce), so no rank is left waiting in a collective.
    """
    dist = torch.distributed
    if not guard.sync_ranks:
        raise GuardError("a sharded snapshot needs every rank to stop at the same step: NanGuard(..., sync_ranks=True)")
    rank, world = dist.get_rank(), dist.get_world_size()
    extra = dict(extra)
    st = guard._as_called(extra.pop("state", None) or guard._states[-1])
    folder = _agree_folder(guard, trigger, st, rank)
    model = guard.model
    program, constants, why, seconds = None, {}, "recording was switched off (export=False)", 0.0
    if guard.export:
        run = snapshot.rerun_copy(st)  # the re-run's own batch (capture/owned.py)
        forward, loss = guard._forward_loss(run)
        with guard._calls_paused():
            program, constants, why, seconds = record(model, run, forward, loss, guard._autocast or None)
    for _, unit in fsdp_units(model):  # the root stays gathered after a forward: save shards, as the optimizer
        unit.reshard()                 # holds them (a backward that follows gathers it again)
    failed = None
    try:
        folder.mkdir(parents=True, exist_ok=True)  # on a host that does not share rank 0's disk
        loss_value = extra.get("loss_value", guard._row().get("loss"))
        tensors, part = _rank_part(model, st, rank, program, constants, why, seconds, loss_value, list(guard.history))
        atomic.write_text(folder / f"rank{rank}.json", json.dumps(part, allow_nan=False))
        if program is not None:
            atomic.write_text(folder / f"rank{rank}.program.json", snapshot._json(program))
    except Exception as e:  # noqa: BLE001 - said on every rank below
        failed = f"rank {rank}: {type(e).__name__}: {first_line(e)}"
    _all_or_none(failed, rank)
    aliases, params = _parameters(model)
    tensors.update({f"model/{n}": p.detach() for n, p in params.items()})
    opt_tensors, opt_info = _optimizer_part(model, guard.optimizer)
    tensors.update(opt_tensors)
    import torch.distributed.checkpoint as dcp

    try:
        meta = dcp.save(tensors, checkpoint_id=str(folder))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP raises a CheckpointException (a BaseException) on every rank
        raise GuardError(f"torch.distributed.checkpoint could not save the shards: {type(e).__name__}: "
                         f"{first_line(e)}") from None
    if rank == 0:
        contents = _contents(guard, model, trigger, st, extra, world, params, aliases, opt_info, meta)
        atomic.write_text(folder / CONTENTS, json.dumps(contents, allow_nan=False))
    dist.barrier()  # every rank returns once the folder is complete
    return str(folder)


def _device() -> torch.device:
    dist = torch.distributed
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_folder(guard: Any, trigger: str, st: snapshot.StepState, rank: int) -> Path:
    """Rank 0 creates a new folder and tells the others its name (one broadcast)."""
    name = ""
    if rank == 0:
        micro = f"_micro{st.micro_batch}" if st.micro_batch is not None else ""
        base = f"nan_step{guard.step_index:06d}{micro}_{trigger}_{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        try:
            guard.folder.mkdir(parents=True, exist_ok=True)
            for n in range(100):
                cand = base + (f"_{n}" if n else "")
                try:
                    os.mkdir(guard.folder / cand)
                    name = cand
                    break
                except FileExistsError:
                    continue
        except OSError:
            name = ""
    buf = torch.zeros(512, dtype=torch.uint8, device=_device())
    if rank == 0 and name:
        raw = name.encode()[:512]
        buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    torch.distributed.broadcast(buf, 0)
    name = bytes(buf.cpu().tolist()).rstrip(b"\0").decode()
    if not name:
        raise GuardError(f"rank 0 could not create a snapshot folder in {guard.folder}")
    return guard.folder / name


def _all_or_none(failed: str | None, rank: int) -> None:
    flag = torch.tensor([0.0 if failed is None else 1.0], device=_device())
    torch.distributed.all_reduce(flag)
    if float(flag.item()):
        raise GuardError(failed or "another rank could not write its part of the sharded snapshot; none was written")


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").clone(memory_format=torch.contiguous_format)


def encode_tree(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], depth: int = 0) -> Any:
    """A batch as JSON: tensors become {"tensor": key} (stored under `key`), tuples {"tuple": [...]},
    dicts {"dict": [[key, value], ...]}, non-finite floats {"f": "nan"}; anything else {"repr": "..."}."""
    if depth > 12:
        return {"repr": "<nested too deeply>"}
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}/{len(tensors)}"
        tensors[key] = _cpu(obj)
        return {"tensor": key}
    if isinstance(obj, tuple):
        return {"tuple": [encode_tree(v, prefix, tensors, depth + 1) for v in obj]}
    if isinstance(obj, list):
        return [encode_tree(v, prefix, tensors, depth + 1) for v in obj]
    if isinstance(obj, dict):
        return {"dict": [[k if isinstance(k, (str, int)) and not isinstance(k, bool) else repr(k)[:200],
                          encode_tree(v, prefix, tensors, depth + 1)] for k, v in obj.items()]}
    if isinstance(obj, float):
        return encode_float(obj)
    if obj is None or isinstance(obj, (bool, int)):
        return obj
    if isinstance(obj, str):
        return obj[:2000]
    return {"repr": repr(obj)[:200]}


def _rank_part(model: nn.Module, st: snapshot.StepState, rank: int, program: dict | None, constants: dict, why: str | None,
               seconds: float, loss_value: Any, history: list) -> tuple[dict[str, torch.Tensor], dict]:
    tensors: dict[str, torch.Tensor] = {}
    prefix = f"rank{rank}"
    batch = {k: encode_tree(v, f"{prefix}/batch", tensors) for k, v in st.batch.items()}
    consts = {}
    for name, t in constants.items():
        consts[name] = f"{prefix}/constant/{name}"
        tensors[consts[name]] = _cpu(t)
    buffers = {}
    for name, b in model.named_buffers():  # as the step began (BatchNorm's running stats change in place)
        buffers[name] = f"{prefix}/buffer/{name}"
        tensors[buffers[name]] = _cpu(st.buffers.get(name, b))
    part = {"format": FORMAT + ".rank", "rank": rank, "loss_value": _num(loss_value), "micro_batch": st.micro_batch,
            "batch": batch, "constants": consts, "buffers": buffers,
            "program": f"rank{rank}.program.json" if program is not None else None,
            "program_error": None if program is not None else why,
            "history": [{k: _num(v) if isinstance(v, float) else v for k, v in h.items()} for h in history],
            "notes": [f"recording the step took {seconds:.2f} s"] if program is not None else []}
    return tensors, part


def _num(x: Any) -> Any:
    return encode_float(float(x)) if isinstance(x, (float, int)) and not isinstance(x, bool) and x is not None else x


def _parameters(model: nn.Module) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    first: dict[int, str] = {}
    aliases, params = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
            params[name] = p
    return aliases, params


def _optimizer_part(model: nn.Module, optimizer: Any) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The optimizer state's tensors (under optim/) and the rest of it as plain data."""
    if optimizer is None:
        return {}, None
    info: dict[str, Any] = {"class": type(optimizer).__name__}
    try:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, optimizer)
    except Exception as e:  # noqa: BLE001 - the snapshot is still useful without it
        info["error"] = f"{type(e).__name__}: {first_line(e)}"
        return {}, info
    tensors, scalars = {}, {}
    for fqn, entry in (osd.get("state") or {}).items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim/state/{fqn}/{k}"] = v.detach() if is_dtensor(v) else _cpu(v)
            else:
                scalars[f"{fqn}/{k}"] = _plain(v)
    info["state_scalars"] = scalars
    info["param_groups"] = [{k: _plain(v) for k, v in g.items()} for g in osd.get("param_groups") or []]
    return tensors, info


def _plain(v: Any, depth: int = 0) -> Any:
    if isinstance(v, float):
        return encode_float(v)
    if v is None or isinstance(v, (bool, int)):
        return v
    if isinstance(v, str):
        return v[:500]
    if isinstance(v, (list, tuple)) and depth < 4:
        return [_plain(x, depth + 1) for x in list(v)[:10_000]]
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not is_dtensor(v):
        return _plain(v.item(), depth)
    return repr(v)[:200]


def _contents(guard: Any, model: nn.Module, trigger: str, st: snapshot.StepState, extra: dict, world: int,
              params: dict, aliases: dict, opt_info: dict | None, meta: Any) -> dict:
    """nanreplay.json: what the folder holds, as data (rank 0 writes it once every rank's part is on disk)."""
    units = fsdp_units(model)
    first = next((p for p in params.values() if is_dtensor(p)), None)
    mesh = None
    if first is not None:
        m = first.device_mesh
        mesh = {"shape": list(m.shape), "dim_names": list(m.mesh_dim_names or []), "device_type": m.device_type,
                "placements": [str(pl) for pl in first.placements]}
    cls = _user_class(model)
    spec = loss_spec(guard._recorded_loss_fn()) if guard.step_fn is None \
        else {"kind": "step_fn", "spec": snapshot._qualname(guard.step_fn)}
    spec = {k: v for k, v in spec.items() if k != "kwargs"}
    param0 = next(iter(params.values()), None)
    autocast = snapshot._autocast_record(guard._autocast or None)
    return {
        "format": FORMAT, "version": VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "nanreplay_version": __version__,
        "trigger": str(trigger), "step": guard.step_index, "micro_batch": st.micro_batch, "world_size": world,
        "nonfinite_ranks": list(guard._bad_ranks) if guard._bad_ranks is not None else None,
        "strategy": "fsdp2" if units else "replicated", "mesh": mesh,
        "units": [n for n, _ in units], "unit_parameters": unit_parameters(model, units),
        "parameters": list(params), "aliases": aliases, "buffers": [n for n, _ in model.named_buffers()],
        "model_training": model.training,
        "model": {"class": f"{cls.__module__}.{cls.__qualname__}", "factory": guard.factory,
                  "factory_source": "given" if guard.factory else None},
        "loss_spec": spec, "autocast": autocast,
        "grad_norm": _num(extra.get("grad_norm")), "spike_median": _num(extra.get("spike_median")),
        "grad_scale": _num(float(guard.scaler.get_scale())) if guard.scaler is not None else None,
        "optimizer": opt_info,
        "environment": {"torch": str(torch.__version__), "python": platform.python_version(),
                        "device": str(_local(param0).device) if param0 is not None else None,
                        "dtype": str(param0.dtype).removeprefix("torch.") if param0 is not None else None,
                        "cuda": torch.version.cuda, "backend": torch.distributed.get_backend(),
                        "wrapper": type(guard.wrapped).__name__ if guard.wrapped is not model else None},
        "tensors": storage_index(meta),
    }


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if is_dtensor(p) else p


def _user_class(model: nn.Module) -> type:
    """The user's class (FSDP2 swaps in a subclass named FSDP<Class>)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return type(model)
    return next((c for c in type(model).__mro__ if not issubclass(c, FSDPModule)), type(model))


def storage_index(meta: Any) -> dict:
    """DCP's global metadata as plain data: per tensor its dtype, shape and chunks, each with the file and
    byte range that holds it. nanreplay loads from this, never from DCP's pickled `.metadata`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    places: dict[tuple, Any] = {}
    for idx, info in (meta.storage_data or {}).items():
        places[(idx.fqn, tuple(idx.offset) if idx.offset is not None else None)] = info
    out = {}
    for key, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        chunks = []
        for c in md.chunks:
            info = places.get((key, tuple(c.offsets)))
            chunk = {"offsets": list(c.offsets), "sizes": list(c.sizes)}
            if info is not None:
                chunk.update(file=info.relative_path, offset=info.offset, length=info.length)
                if getattr(info, "transform_descriptors", None):
                    chunk["transforms"] = list(info.transform_descriptors)
            chunks.append(chunk)
        out[key] = {"dtype": str(md.properties.dtype).removeprefix("torch."), "shape": list(md.size), "chunks": chunks}
    return out
