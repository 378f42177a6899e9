"""Merging the ranks of a sharded snapshot into one answer: which rank went non-finite first, where the
culprit ran, and whether the NaN crossed ranks through a collective.

Pure functions of per-rank summaries (`RankResult`, plain data: the N-rank analysis passes them between
processes as JSON). Each rank's replay is its OWN step: its batch through the (shared) weights, forward,
loss and its local backward. What couples the ranks of a data-parallel step is the gradient reduction —
FSDP2's reduce-scatter (each rank gets the sum of every rank's gradient, for its own rows) or DDP's
all-reduce (every rank gets all of it) — and, for weights, FSDP2's all-gather. A rank whose own step is
finite but whose reduced gradient is not got the NaN through the collective: that is a crossing, and the
collective is an event on the chain. Where ranks differ, "first" means earliest in the step: a
non-finite batch before any op; then by the position of each rank's first culprit event in the step
(forward before backward; forward in op order; backward in reverse op order, as autograd runs it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from nanreplay.enums import Verdict

REDUCE_OPS = {"fsdp2": "c10d.reduce_scatter", "replicated": "c10d.all_reduce"}
GATHER_OP = "c10d.all_gather"


@dataclass
class RankResult:
    """One rank's replay, summarised (all plain data)."""

    rank: int
    verdict: str
    loss: float | str | None = None
    failure: dict | None = None  # {"what", "name", "kind"}
    culprit: dict | None = None  # the culprit as the JSON contract has it, for this rank
    key: list | None = None  # position of the rank's first culprit event in the step (see module doc)
    chain: list[dict] = field(default_factory=list)
    bad_grads: dict[str, dict] = field(default_factory=dict)  # its own gradient: name -> {kind, nan, inf, rows}
    reduced_bad: dict[str, str] | None = None  # observed after the reduce (N-rank replays): name -> kind
    leaves: list[dict] = field(default_factory=list)  # non-finite batch tensors of this rank
    error: str | None = None  # why this rank was not replayed

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RankResult:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def culprit_key(event: dict) -> list:
    """Where an event sits in a step, comparable across ranks (see the module doc)."""
    fwd = event.get("fwd")
    if event.get("phase") == "forward":
        return [1, fwd if fwd is not None else 0, event.get("event") or 0]
    return [2, -(fwd if fwd is not None else 0), event.get("event") or 0]


def receivers(contents: dict, name: str, senders: dict[int, dict], results: dict[int, RankResult]) -> list[int]:
    """The ranks whose reduced gradient of `name` is non-finite: observed where the replay ran the
    collective, else as the collective works (all-reduce: every rank; FSDP2's reduce-scatter on dim 0:
    the ranks whose rows hold a non-finite entry of some sender's gradient)."""
    from nanreplay.formats.sharded import fsdp_rows

    world = contents["world_size"]
    seen = [r for r, res in results.items() if res.reduced_bad is not None]
    if seen and len(seen) == len(results):
        return sorted(r for r, res in results.items() if name in (res.reduced_bad or {}))
    if contents.get("strategy") != "fsdp2":
        return list(range(world))
    shape = (contents.get("tensors") or {}).get(f"model/{name}", {}).get("shape") or []
    spans = fsdp_rows(shape, world)
    rows: set[int] | None = set()
    for g in senders.values():
        if g.get("rows") is None or rows is None:
            rows = None
            break
        rows.update(g["rows"])
    return [r for r, (lo, hi) in enumerate(spans) if hi > lo and (rows is None or any(lo <= x < hi for x in rows))]


def collectives(contents: dict, results: dict[int, RankResult]) -> list[dict]:
    """The gradient reductions that carried a non-finite value: one event per FSDP unit (or one all-reduce)."""
    op = REDUCE_OPS.get(contents.get("strategy"), "c10d.all_reduce")
    unit_of = {p: u for u, ps in (contents.get("unit_parameters") or {}).items() for p in ps}
    names = sorted({n for res in results.values() for n in res.bad_grads}
                   | {n for res in results.values() for n in (res.reduced_bad or {})})
    groups: dict[str, dict] = {}
    for name in names:
        senders = {r: res.bad_grads[name] for r, res in results.items() if name in res.bad_grads}
        to = receivers(contents, name, senders, results)
        if not to:
            continue
        unit = unit_of.get(name, "") if contents.get("strategy") == "fsdp2" else ""
        g = groups.setdefault(unit, {"op": op, "unit": unit, "params": [], "from_ranks": set(), "to_ranks": set(),
                                     "nan": 0, "inf": 0, "observed": False})
        g["params"].append(name)
        g["from_ranks"].update(senders)
        g["to_ranks"].update(to)
        g["nan"] += sum(int(s.get("nan") or 0) for s in senders.values())
        g["inf"] += sum(int(s.get("inf") or 0) for s in senders.values())
        g["observed"] = g["observed"] or any(res.reduced_bad is not None for res in results.values())
    out = []
    for g in groups.values():
        g["from_ranks"], g["to_ranks"] = sorted(g["from_ranks"]), sorted(g["to_ranks"])
        g["crossed_to"] = [r for r in g["to_ranks"] if r not in g["from_ranks"]]
        g["kind"] = "nan" if g["nan"] or not g["inf"] else "inf"
        out.append(g)
    return out


def first_rank(results: dict[int, RankResult]) -> tuple[RankResult | None, str]:
    """The rank that went non-finite first, and why it counts as first."""
    bad_input = [r for r in results.values() if r.verdict == Verdict.NONFINITE_INPUT]
    if bad_input:
        first = min(bad_input, key=lambda r: r.rank)
        return first, f"its batch was already non-finite before any op ran ({_leaf_names(first)})"
    culprits = [r for r in results.values() if r.verdict == Verdict.CULPRIT_FOUND and r.key is not None]
    if not culprits:
        return None, "no rank's own step is non-finite when replayed"
    first = min(culprits, key=lambda r: (list(r.key), r.rank))
    same = [r.rank for r in culprits if r.key == first.key and r.rank != first.rank]
    c = first.culprit or {}
    at = f"{c.get('op')} in {_module(c.get('module'))} ({c.get('phase')})"
    if same:
        return first, (f"every one of ranks {_ranks([first.rank, *same])} produced it at the same op, {at}; "
                       "the lowest rank is named")
    if len(culprits) > 1:
        return first, f"its first non-finite op, {at}, comes earlier in the step than any other rank's"
    return first, f"it is the only rank whose own step produces a non-finite value ({at})"


def merge(contents: dict, results: dict[int, RankResult], *, replay: str, nproc: int) -> dict:
    """The `distributed` block of the analysis JSON."""
    first, why = first_rank(results)
    colls = collectives(contents, results)
    crossed = sorted({r for g in colls for r in g["crossed_to"]} - _origins(results))
    block = {
        "world_size": contents["world_size"], "strategy": contents.get("strategy"), "replay": replay, "nproc": nproc,
        "captured_nonfinite_ranks": contents.get("nonfinite_ranks"),
        "first_rank": first.rank if first else None, "first_reason": why,
        "culprit_rank": first.rank if first and first.verdict == Verdict.CULPRIT_FOUND else None,
        "crossed": bool(crossed), "crossed_to": crossed, "collectives": colls,
        "ranks": [_rank_row(results[r], colls) for r in sorted(results)],
    }
    block["explanation"] = explain(block, first, results)
    return block


def _origins(results: dict[int, RankResult]) -> set[int]:
    return {r for r, res in results.items() if res.verdict in (Verdict.CULPRIT_FOUND, Verdict.NONFINITE_INPUT)}


def _rank_row(res: RankResult, colls: list[dict]) -> dict:
    via = [{"op": g["op"], "unit": g["unit"], "from_ranks": g["from_ranks"]} for g in colls
           if res.rank in g["crossed_to"]]
    origin = "local" if res.verdict in (Verdict.CULPRIT_FOUND, Verdict.NONFINITE_INPUT) else \
        "collective" if via else None
    c = res.culprit or {}
    return {"rank": res.rank, "verdict": res.verdict, "loss": res.loss, "failure": res.failure, "origin": origin,
            "culprit": {k: c.get(k) for k in ("op", "forward_op", "phase", "kind", "module", "source")} if c else None,
            "received": via, "nonfinite_leaves": [lf["name"] for lf in res.leaves], "error": res.error}


def explain(block: dict, first: RankResult | None, results: dict[int, RankResult]) -> str:
    """One paragraph: where it started, which ranks got it through which collective."""
    world = block["world_size"]
    if first is None:
        errs = [r for r in results.values() if r.error]
        if errs:
            return f"No rank's replay found the non-finite value ({len(errs)} of {world} ranks could not be replayed)."
        return (f"None of the {world} ranks' own steps is non-finite when replayed; the captured failure did not "
                "reproduce.")
    c = first.culprit or {}
    if first.verdict == Verdict.NONFINITE_INPUT:
        start = f"Rank {first.rank}'s batch holds NaN/Inf ({_leaf_names(first)}) before the model runs"
    else:
        start = (f"The non-finite value started on rank {first.rank}: {c.get('op')} in {_module(c.get('module'))} "
                 f"produced {str(c.get('kind') or 'nan').upper()} in the {c.get('phase')} pass")
    locals_ = sorted(_origins(results) - {first.rank})
    parts = [start + "."]
    if locals_:
        many = len(locals_) > 1
        parts.append(f"Rank{'s' if many else ''} {_ranks(locals_)} went non-finite in {'their' if many else 'its'} "
                     "own step as well.")
    crossed = block["crossed_to"]
    if crossed:
        ops = sorted({g["op"] for g in block["collectives"] if g["crossed_to"]})
        units = sorted({g["unit"] for g in block["collectives"] if g["crossed_to"]})
        what = "reduce-scatter" if "c10d.reduce_scatter" in ops else "all-reduce"
        kind = "NaN" if any(g["kind"] == "nan" for g in block["collectives"] if g["crossed_to"]) else "Inf"
        where = f" of {', '.join(_unit(u) for u in units[:4])}" if units else ""
        parts.append(f"Rank{'s' if len(crossed) > 1 else ''} {_ranks(crossed)} computed a finite step of "
                     f"{'their' if len(crossed) > 1 else 'its'} own; {'their' if len(crossed) > 1 else 'its'} gradients "
                     f"became non-finite only in the gradient {what}{where}, which sums every rank's gradient: "
                     f"the {kind} crossed ranks through that collective.")
    elif world > 1 and not locals_:
        parts.append("No other rank's gradients became non-finite through the gradient reduction.")
    return " ".join(parts)


def _leaf_names(res: RankResult) -> str:
    return ", ".join(lf["name"] for lf in res.leaves[:3]) or "its batch"


def _module(m: Any) -> str:
    return "the loss" if m == "<loss>" else "the model itself" if m in ("", None) else str(m)


def _unit(u: str) -> str:
    return "the root unit" if u == "" else u


def _ranks(rs: list[int]) -> str:
    rs = sorted(rs)
    return ", ".join(map(str, rs[:-1])) + f" and {rs[-1]}" if len(rs) > 1 else str(rs[0])
