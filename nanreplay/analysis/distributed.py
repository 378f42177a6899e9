"""A sharded snapshot analyzed on one process: every rank's step replayed, the ranks merged.

The weights are read once, whole (DCP reshards the saved shards), and shared by every rank's step
program; each rank's batch, buffers and recorded constants are its own. Each rank's step is replayed
under the usual instrumentation, one after the other, and summarised (`ranks.RankResult`); its gradients
are freed before the next. The rank that went non-finite first gets the full analysis (diagnosis, fix
verification, precision probe: `pipeline.analyze_subject`), and `finish()` adds what only the ranks
together say: `culprit.rank`, the `distributed` block, the collectives on the chain.
The N-rank analysis (`--nproc N`, analysis/rankworker.py) produces the same summaries from FSDP replays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from nanreplay import culprit as culprit_mod
from nanreplay import replay, stats
from nanreplay.analysis.contract import Analysis, culprit_json, event_json
from nanreplay.analysis.ranks import RankResult, merge
from nanreplay.enums import Verdict
from nanreplay.errors import SnapshotError
from nanreplay.formats import sharded
from nanreplay.formats.rebuild import parse_device
from nanreplay.pytree import iter_tensors
from nanreplay.replay.records import Step
from nanreplay.replay.subject import Subject

MAX_ROWS = 100_000  # non-finite gradient rows kept per parameter (more: "every row")


@dataclass
class Ranks:
    """Every rank's replay of one sharded snapshot, on one process."""

    results: dict[int, RankResult]
    subjects: dict[int, Subject] = field(default_factory=dict)
    steps: dict[int, Step] = field(default_factory=dict)
    weights: list[dict] = field(default_factory=list)  # non-finite parameters: name, nan, inf, rows
    t_loaded: float = 0.0

    def chosen(self, snap) -> int:
        """The rank whose step the analysis is about: the first to go non-finite; else the first the guard saw."""
        from nanreplay.analysis.ranks import first_rank

        first, _ = first_rank(self.results)
        owners = owners_of(snap.raw["contents"], self.weights[0]) if self.weights else []
        order = ([first.rank] if first else []) + owners + list(snap.raw["contents"].get("nonfinite_ranks") or []) + \
            sorted(self.results)
        r = next((r for r in order if r in self.subjects), None)
        if r is None:
            errors = "; ".join(f"rank {res.rank}: {res.error}" for res in self.results.values() if res.error)
            raise SnapshotError(f"{snap.path}: no rank's step can be replayed ({errors})")
        return r

    def history(self, snap, r: int) -> list[dict]:
        return list(snap.raw["ranks"][r].get("history") or [])


def replay_ranks(snap, *, device: str | None, max_memory: int | None) -> Ranks:
    """Load the weights once, replay each rank's step, summarise each."""
    c = snap.raw["contents"]
    dev = parse_device(device)
    keys = [f"model/{n}" for n in c["parameters"]]
    for r in range(c["world_size"]):
        keys += sharded.rank_state_keys(snap, r)
    tensors = sharded.load_whole(snap, keys, dev, max_memory)
    ranks = Ranks(results={})
    ranks.weights = nonfinite_weights({n: tensors[f"model/{n}"] for n in c["parameters"]})
    ranks.t_loaded = time.perf_counter()
    for r in range(c["world_size"]):
        try:
            subject = sharded.rank_subject(snap, r, tensors, dev, max_memory)
        except SnapshotError as e:
            ranks.results[r] = RankResult(r, "not_replayed", error=str(e))
            continue
        ranks.subjects[r] = subject
        if ranks.weights:
            ranks.results[r] = RankResult(r, Verdict.NONFINITE_PARAMETERS)
            continue
        step = replay.run_subject(subject)  # (a rank whose batch is non-finite too: its gradients reach the others)
        res = summarize(r, step, local_gradients(subject.model))
        subject.model.zero_grad(set_to_none=True)  # every rank's gradients at once would be world x the weights
        leaves = batch_leaves(subject)
        if leaves:
            res.verdict, res.leaves, res.culprit, res.key = Verdict.NONFINITE_INPUT, leaves, None, None
        else:
            ranks.steps[r] = step
        ranks.results[r] = res
    return ranks


def nonfinite_weights(params: dict[str, torch.Tensor]) -> list[dict]:
    out = []
    for name, p in params.items():
        nan, inf = stats.leaf_counts(p)
        if nan or inf:
            out.append({"name": name, "nan": nan, "inf": inf, "rows": bad_rows(p)})
    return out


def batch_leaves(subject: Subject) -> list[dict]:
    rows = []
    for label, value, role in ((subject.input_label, subject.inputs, "input"),
                               (subject.target_label, subject.target, "target")):
        for n, t in iter_tensors(value):
            nan, inf = stats.leaf_counts(t)
            if (nan or inf) and not stats.mask_values(t):  # a -inf mask is replayed, as on one process
                rows.append({"name": f"{label}{n}", "role": role, "nan": nan, "inf": inf, "shape": list(t.shape)})
    return rows


def bad_rows(t: torch.Tensor) -> list[int] | None:
    """Indices along dim 0 holding a NaN/Inf (None: a 0-d tensor, or too many to list)."""
    if t.dim() == 0 or not t.is_floating_point():
        return None
    bad = ~torch.isfinite(t.detach().reshape(t.shape[0], -1)).all(dim=1)
    idx = bad.nonzero().flatten()
    return idx.tolist() if idx.numel() <= MAX_ROWS else None


def local_gradients(model: torch.nn.Module) -> dict[str, dict]:
    """This rank's own gradients that are non-finite: name -> {kind, nan, inf, rows}."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        nan, inf = stats.leaf_counts(p.grad)
        if nan or inf:
            out[name] = {"kind": "nan" if nan else "inf", "nan": nan, "inf": inf, "rows": bad_rows(p.grad)}
    return out


def summarize(r: int, step: Step, bad_grads: dict[str, dict], reduced_bad: dict[str, str] | None = None) -> RankResult:
    """A rank's replay as plain data: its failure, culprit, chain and non-finite gradients."""
    from nanreplay.analysis.ranks import culprit_key

    chain = culprit_mod.chain(step.events, step.failure.event if step.failure else None)
    c = culprit_mod.culprit(step.events, chain)
    res = RankResult(r, Verdict.CULPRIT_FOUND if c is not None else Verdict.NOT_REPRODUCED,
                     loss=stats.jsonable(step.loss), bad_grads=bad_grads, reduced_bad=reduced_bad,
                     chain=[event_json(step, step.events[i]) for i in chain])
    if step.failure is not None:
        res.failure = {"what": step.failure.what, "name": step.failure.name, "kind": str(step.failure.kind)}
    if c is not None:
        ev = step.events[c]
        res.culprit = stats.jsonable(culprit_json(step, ev))
        res.key = culprit_key({"phase": str(ev.phase), "fwd": ev.fwd, "event": ev.index})
    return res


# ------------------------------------------------------------------ the merged analysis


def finish(result: Analysis, snap, ranks: Ranks | dict[int, RankResult], r: int, *, replay: str, nproc: int) -> None:
    """Add what the ranks say together to rank r's analysis (in place)."""
    results = ranks.results if isinstance(ranks, Ranks) else ranks
    weights = ranks.weights if isinstance(ranks, Ranks) else []
    c = snap.raw["contents"]
    block = merge(c, results, replay=replay, nproc=nproc)
    if weights:
        block["collectives"].append(weight_gather(c, weights))
        block["explanation"] = weights_sentence(c, weights)
        block["first_rank"] = owners_of(c, weights[0])[0]
        block["first_reason"] = "its shard of the weights was already non-finite before the step"
    for leaf in result.nonfinite_leaves:  # (an N-rank analysis saw its own shard: say the whole shape)
        if leaf.get("role") == "parameter" and f"model/{leaf.get('name')}" in c["tensors"]:
            leaf["shape"] = list(c["tensors"][f"model/{leaf['name']}"]["shape"])
    result.distributed = block
    if result.culprit is not None:
        result.culprit["rank"] = r
    for e in result.chain:
        e["rank"] = r
    for leaf in result.nonfinite_leaves:
        leaf.setdefault("rank", r if leaf.get("role") in ("input", "target") else None)
    last = result.chain[-1]["index"] if result.chain else None
    base = max([e["index"] for e in result.chain] + [len(result.step.events) if result.step else 0]) + 1
    for k, g in enumerate(x for x in block["collectives"] if r in x["from_ranks"] or x["op"] == "c10d.all_gather"):
        gather = g["op"] == "c10d.all_gather"  # weights spread before the forward; the rest reduce gradients
        result.chain.append({
            "index": base + k, "phase": "forward" if gather else "backward", "kind": g["kind"], "op": g["op"],
            "module": g["unit"],
            "role": "propagation", "forward_op": None, "backward_node": None, "source": None,
            "nan": g["nan"], "posinf": g["inf"], "neginf": 0, "numel": g["nan"] + g["inf"],
            "parents": [last] if last is not None and not gather else [], "rank": r, "collective": True,
            "from_ranks": g["from_ranks"], "to_ranks": g["to_ranks"], "params": g["params"][:50]})
    if block["explanation"]:
        result.diagnosis = dict(result.diagnosis or {})
        result.diagnosis["explanation"] = (str(result.diagnosis.get("explanation") or "") + " " + block["explanation"]).strip()
        result.diagnosis["distributed"] = block["explanation"]
    for res in results.values():
        if res.error:
            result.warnings.append(f"rank {res.rank} was not replayed: {res.error}")
    result.model["how"] = f"the step programs of {c['world_size']} ranks in the sharded snapshot " \
                          f"(no training code needed); rank {r} in detail"
    result.model["parameters"] = sum(sharded.numel_of(c, f"model/{n}") for n in c["parameters"])


def weight_gather(c: dict, weights: list[dict]) -> dict:
    """Non-finite weights reach every rank through FSDP2's all-gather (DDP: every rank holds them anyway)."""
    owners = sorted({o for w in weights for o in owners_of(c, w)})
    unit_of = {p: u for u, ps in (c.get("unit_parameters") or {}).items() for p in ps}
    return {"op": "c10d.all_gather" if c.get("strategy") == "fsdp2" else "replicated",
            "unit": unit_of.get(weights[0]["name"], ""),
            "params": [w["name"] for w in weights], "from_ranks": owners, "to_ranks": list(range(c["world_size"])),
            "crossed_to": [x for x in range(c["world_size"]) if x not in owners],
            "nan": sum(w["nan"] for w in weights), "inf": sum(w["inf"] for w in weights),
            "kind": "nan" if any(w["nan"] for w in weights) else "inf", "observed": False}


def owners_of(c: dict, w: dict) -> list[int]:
    world = c["world_size"]
    if c.get("strategy") != "fsdp2":
        return list(range(world))
    shape = c["tensors"][f"model/{w['name']}"]["shape"]
    rows = w.get("rows")
    return [r for r, (lo, hi) in enumerate(sharded.fsdp_rows(shape, world))
            if hi > lo and (rows is None or any(lo <= x < hi for x in rows))]


def weights_sentence(c: dict, weights: list[dict]) -> str:
    w = weights[0]
    owners = owners_of(c, w)
    if c.get("strategy") == "fsdp2":
        return (f"The weights were already non-finite before this step: {w['name']} in the shard{'s' if len(owners) > 1 else ''} "
                f"of rank{'s' if len(owners) > 1 else ''} {', '.join(map(str, owners))}; FSDP's all-gather hands it to "
                "every rank before the forward, so every rank's step fails.")
    return f"The weights were already non-finite before this step ({w['name']}), on every rank."
