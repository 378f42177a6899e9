"""One rank of `nanreplay analyze DIR --nproc N` (started by torch.distributed.run; not a user command).

    python -m torch.distributed.run --standalone --nproc-per-node N -m nanreplay.analysis.rankworker DIR --out TMP

Rank r replays captured rank r's step. FSDP2 snapshots run as FSDP2 (formats/shardedstep.py): each rank
loads only its shard of the weights (DCP reshards to this world size), FSDP2 gathers a unit's weights around
its ops and reduce-scatters the gradients, for real; nanreplay's instrumentation sees the step's own ops
but not FSDP's traffic (`torch_internals.fsdp_traffic_unseen`), and looks at each parameter group's
gradients just before and just after its reduce-scatter: a rank whose own gradient is finite and whose
reduced one is not got the NaN through the collective. Replicated (DDP) snapshots load the whole weights on
every rank and all-reduce the gradients after backward, as DDP did.

Every rank writes its summary (`rank<r>.result.json`); the rank that went non-finite first then writes the
merged analysis (`analysis.json`: the usual analysis of its own step, without fix verification or the
precision probe, which would re-run the step on every rank; with `--html` also `report.html`) to TMP,
where the launching process reads it. Run by hand across hosts (`--nnodes`), TMP is shared storage.
A rank's error goes to `rank<r>.error.json` (its class and its one line) and ends the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from nanreplay import formats, replay, stats
from nanreplay import torch_internals as ti
from nanreplay.analysis import distributed
from nanreplay.analysis.pipeline import analyze_subject
from nanreplay.analysis.ranks import RankResult, first_rank
from nanreplay.enums import Kind, Verdict
from nanreplay.errors import NanReplayError, UsageError
from nanreplay.formats import dcpread, sharded
from nanreplay.formats.loss_spec import loss_label
from nanreplay.formats.native import replay_options
from nanreplay.formats.program import decode
from nanreplay.formats.rebuild import parse_device
from nanreplay.formats.shardedstep import ShardedStepModule, check_program, local_view
from nanreplay.replay.records import Failure
from nanreplay.replay.subject import Subject, to_device


class ReduceWatch:
    """Each FSDP2 parameter group's gradients just before (this rank's own) and just after (reduced) its
    reduce-scatter; with the replay's Recorder, the event that made each non-finite gradient."""

    def __init__(self):
        self.rows: dict[str, dict] = {}  # grad_stats of this rank's own gradient, by parameter
        self.bad: dict[str, dict] = {}  # this rank's own non-finite gradients
        self.events: dict[str, int | None] = {}
        self.reduced_bad: dict[str, str] = {}

    def on_reduce(self, group: Any, run, modes: list) -> Any:
        rec = next((m.rec for m in modes if hasattr(m, "rec") and hasattr(m.rec, "nonfinite")), None)
        for name, g in ti.fsdp_group_grads(group, reduced=False):
            if g is None or name is None:
                continue
            self.rows[name] = stats.grad_stats(name, SimpleNamespace(grad=g, shape=g.shape, dtype=g.dtype,
                                                                     numel=g.numel))
            nan, inf = stats.leaf_counts(g)
            if nan or inf:
                self.bad[name] = {"kind": "nan" if nan else "inf", "nan": nan, "inf": inf,
                                  "rows": distributed.bad_rows(g)}
                hit = rec.nonfinite.get(g) if rec is not None else None
                self.events[name] = hit[0] if hit is not None else None
        out = run()
        for name, g in ti.fsdp_group_grads(group, reduced=True):
            if g is not None and name is not None and g.numel():
                nan, inf = stats.leaf_counts(g)
                if nan or inf:
                    self.reduced_bad[name] = "nan" if nan else "inf"
        return out

    def failure(self) -> Failure | None:
        """As a one-process replay defines it: the first non-finite parameter gradient (this rank's own)."""
        best = None
        for name, b in self.bad.items():
            ev = self.events.get(name)
            if best is None or (ev is not None and (best[1] is None or ev < best[1])):
                best = (name, ev, b["kind"])
        return Failure("gradient", best[0], Kind.NAN if best[2] == "nan" else Kind.INF, best[1]) if best else None


class _Grads:
    """What `replay.run` reads of the model for gradients: nothing (FSDP's reduced shards are not this rank's
    own gradient); the ReduceWatch supplies them."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=True)

    def named_parameters(self, *args, **kwargs):
        return iter(())


def fsdp_subject(snap, r: int, dev: torch.device, max_memory: int | None) -> tuple[Subject, ShardedStepModule]:
    """Rank r's step on this rank, its weights as FSDP2 shards of this world size."""
    c, d = snap.raw["contents"], snap.raw["ranks"][r]
    if not d.get("program"):
        raise UsageError(f"{snap.path}: rank {r} holds no step program ({d.get('program_error') or 'not recorded'})")
    program = decode(sharded.read_json_text(Path(snap.path) / d["program"]))
    t = sharded.load_whole(snap, sharded.rank_state_keys(snap, r), torch.device("cpu"), max_memory)
    batch = {k: sharded.build_tree(v, t) for k, v in d["batch"].items()}
    consts = {n: t[k] for n, k in d["constants"].items()}
    buffers = {n: t[k] for n, k in d["buffers"].items()}
    entries = snap.raw["entries"]
    shapes = {n: (list(entries[f"model/{n}"].shape), entries[f"model/{n}"].dtype) for n in c["parameters"]}
    aliases = c.get("aliases") or {}
    bound = check_program(program, shapes, batch, consts, buffers, aliases, f"{snap.path} (rank {r})")
    if max_memory is not None and bound > max_memory:
        raise UsageError(f"{snap.path}: replaying rank {r}'s step needs about {bound >> 20} MiB, more than --max-memory")
    state = {n: torch.empty(s, dtype=dt, device="meta") for n, (s, dt) in shapes.items()}
    state.update(buffers)
    module = ShardedStepModule(program, state, list(c["parameters"]), aliases, consts, c["units"],
                               step_fn="batch" in batch)
    from torch.distributed.device_mesh import init_device_mesh

    module.shard(init_device_mesh(dev.type, (torch.distributed.get_world_size(),)))
    module.to_empty(device=dev)
    module.adopt(buffers, consts, dev)
    module.train(bool(c.get("model_training", True)))
    targets = {f"model/{n}": p for n, p in module.named_parameters()}
    with torch.no_grad():
        dcpread.load(snap.path, entries, targets, max_memory=max_memory)
    inputs, target = (batch["batch"], None) if "batch" in batch else (batch.get("inputs"), batch.get("target"))
    cls = str((c.get("model") or {}).get("class") or "").rsplit(".", 1)[-1] or None
    subject = Subject(model=module, inputs=to_device(inputs, dev), target=to_device(target, dev), loss_fn=None,
                      loss_name=loss_label(c.get("loss_spec") or {}), device=dev,
                      how=f"rank {r}'s step program, FSDP2-sharded over {torch.distributed.get_world_size()} ranks",
                      site=module.site, model_class=cls, input_label="batch" if "batch" in batch else "inputs",
                      program=True, memory_bound=bound,
                      **replay_options({"autocast": c.get("autocast"), "grad_scale": c.get("grad_scale")}, dev))
    return subject, module


def _agree(flag: bool, dev: torch.device) -> bool:
    """Any rank's flag (every rank must take the same path through the collectives)."""
    t = torch.tensor([1.0 if flag else 0.0], device=dev)
    torch.distributed.all_reduce(t)
    return bool(t.item())


def replay_fsdp(snap, r: int, dev: torch.device, max_memory: int | None):
    subject, module = fsdp_subject(snap, r, dev, max_memory)
    c = snap.raw["contents"]
    weights = []
    for name, p in module.named_parameters():
        local = p.to_local()
        nan, inf = stats.leaf_counts(local)
        if nan or inf:
            lo = sharded.fsdp_rows(list(p.shape), c["world_size"])[r][0]
            rows = distributed.bad_rows(local)
            weights.append({"name": name, "nan": nan, "inf": inf, "rows": [lo + x for x in rows] if rows else None})
    leaves = distributed.batch_leaves(subject)
    if _agree(bool(weights), dev):
        return RankResult(r, Verdict.NONFINITE_PARAMETERS), subject, module, None, weights
    watch = ReduceWatch()
    with ti.fsdp_traffic_unseen(watch.on_reduce), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's "returned a view tensor" notes about segment outputs
        # lazy_counts=False: the failure is this rank's own gradient before the reduce (the watch's), not one
        # `run` sees, so every event is counted (Recorder.counted)
        step = replay.run(_Grads(module), subject.forward, subject.loss, names=subject.names, prepare=subject.prepare,
                          site=subject.site, lazy_counts=False)
    if step.failure is None:
        step.failure = watch.failure()
    step.grads = [watch.rows.get(n) or {"name": n, "shape": list(p.shape), "dtype": stats.dtype_name(p.dtype),
                                        "has_grad": False, "mean": None, "std": None, "max_abs": None, "nan": 0,
                                        "inf": 0, "grad_shape": None}
                  for n, p in module.named_parameters()]
    res = distributed.summarize(r, step, watch.bad, watch.reduced_bad)
    if leaves:
        res.verdict, res.leaves, res.culprit, res.key = Verdict.NONFINITE_INPUT, leaves, None, None
    return res, subject, module, step, weights


def replay_replicated(snap, r: int, dev: torch.device, max_memory: int | None):
    """A DDP snapshot: the whole weights on every rank; the gradient all-reduce run for real after backward."""
    c = snap.raw["contents"]
    keys = [f"model/{n}" for n in c["parameters"]] + sharded.rank_state_keys(snap, r)
    subject = sharded.rank_subject(snap, r, sharded.load_whole(snap, keys, dev, max_memory), dev, max_memory)
    weights = distributed.nonfinite_weights(dict(subject.model.named_parameters()))
    leaves = distributed.batch_leaves(subject)
    if weights:
        return RankResult(r, Verdict.NONFINITE_PARAMETERS), subject, subject.model, None, weights
    step = replay.run_subject(subject)
    own = distributed.local_gradients(subject.model)
    reduced = {}
    with torch.no_grad():
        for name, p in subject.model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.distributed.all_reduce(g)
            nan, inf = stats.leaf_counts(g)
            if nan or inf:
                reduced[name] = "nan" if nan else "inf"
    res = distributed.summarize(r, step, own, reduced)
    if leaves:
        res.verdict, res.leaves, res.culprit, res.key = Verdict.NONFINITE_INPUT, leaves, None, None
    return res, subject, subject.model, step, weights


def work(args: argparse.Namespace) -> None:
    dist = torch.distributed
    r, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    t0 = time.perf_counter()
    snap = formats.load(args.folder, max_memory=args.max_memory)
    if snap.format != "sharded":
        raise UsageError(f"{args.folder}: --nproc needs a sharded snapshot folder")
    c = snap.raw["contents"]
    if world != c["world_size"]:
        raise UsageError(f"{args.folder}: the snapshot is of {c['world_size']} ranks; analyze it with "
                         f"--nproc {c['world_size']} (or on one process, without --nproc)")
    dev = parse_device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    replay_rank = replay_fsdp if c["strategy"] == "fsdp2" else replay_replicated
    res, subject, module, step, weights = replay_rank(snap, r, dev, args.max_memory)
    t_replay = time.perf_counter()
    (out / f"rank{r}.result.json").write_text(json.dumps(stats.jsonable({"result": res.to_json(), "weights": weights})))
    dist.barrier()
    docs = [json.loads((out / f"rank{k}.result.json").read_text()) for k in range(world)]
    results = {k: RankResult.from_json(d["result"]) for k, d in enumerate(docs)}
    first, _ = first_rank(results)
    owners = [k for k, d in enumerate(docs) if d["weights"]]  # non-finite weights: a rank whose shard holds them
    chosen = first.rank if first else owners[0] if owners else next(iter(c.get("nonfinite_ranks") or []), 0)
    if r == chosen:
        view = dataclasses.replace(subject, model=local_view(module)) if c["strategy"] == "fsdp2" else subject
        snap.rank, snap.history = r, list(snap.raw["ranks"][r].get("history") or [])
        invocation = {"model": None, "loss": None, "device": args.device, "trust": False, "source": args.source,
                      "nproc": world}
        result = analyze_subject(snap, view, path=args.folder, invocation=invocation, verify=False, t0=t0,
                                 t_load=t0, step=step, probe=False)
        ranks = distributed.Ranks(results=results, weights=_weights(docs, c))
        distributed.finish(result, snap, ranks, r, replay="nproc", nproc=world)
        result.warnings.append(f"analyzed on {world} ranks: fixes are not verified and the precision probe does not "
                               "run (both re-run the step); analyze on one process for them")
        result.stats.setdefault("timings", {})["replay"] = t_replay - t0
        (out / "analysis.json").write_text(json.dumps(result.to_json(), allow_nan=False))
        if args.html:
            from nanreplay.report.html import write_report

            write_report(result, str(out / "report.html"))
    dist.barrier()


def _weights(docs: list[dict], c: dict) -> list[dict]:
    """Non-finite weights as every rank saw its shard (FSDP2), or as rank 0 saw them whole (replicated)."""
    if c["strategy"] != "fsdp2":
        return docs[0]["weights"]
    merged: dict[str, dict] = {}
    for d in docs:
        for w in d["weights"]:
            m = merged.setdefault(w["name"], {"name": w["name"], "nan": 0, "inf": 0, "rows": []})
            m["nan"], m["inf"] = m["nan"] + w["nan"], m["inf"] + w["inf"]
            m["rows"] = None if m["rows"] is None or w["rows"] is None else m["rows"] + w["rows"]
    return list(merged.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanreplay.analysis.rankworker")
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device")
    ap.add_argument("--max-memory", type=int)
    ap.add_argument("--source", action="append")
    ap.add_argument("--cwd", help="the folder the analysis was started in (paths are shown relative to it)")
    ap.add_argument("--html", action="store_true", help="also write the report, report.html, next to analysis.json")
    args = ap.parse_args(argv)
    if args.cwd:
        os.chdir(args.cwd)  # (sys.path[0] stays the launcher's private folder)
    torch.set_num_threads(1)
    dev = parse_device(args.device) if args.device else torch.device("cpu")
    torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank = torch.distributed.get_rank()
    token = replay.SOURCE_ROOTS.set(tuple(os.path.abspath(s) for s in (args.source or [])))
    try:
        work(args)
    except NanReplayError as e:
        Path(args.out, f"rank{rank}.error.json").write_text(json.dumps({"type": type(e).__name__, "message": str(e)}))
        return 3
    finally:
        replay.SOURCE_ROOTS.reset(token)
    try:  # gloo can abort a process that tears down while a peer is still connected: leave together
        torch.distributed.barrier()
    except Exception:  # noqa: BLE001, S110 - a peer that already failed has said why in its own error file
        pass
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":  # pragma: no cover - runs under torch.distributed.run
    sys.exit(main())
