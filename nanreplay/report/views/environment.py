"""How the step was run and how to run it again: the precision probe, the environment, the reproduce commands."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from nanreplay.analysis.result import precision_sentence as sentence_from_rows
from nanreplay.report.format import num
from nanreplay.report.views.elements import Cell, Fact


@dataclass
class PrecisionView:
    rows: list[list[Cell]]
    sentence: str


def precision_view(d: dict) -> PrecisionView | None:
    rows_in = d.get("precision") or []
    if not rows_in:
        return None
    rows = []
    for r in rows_in:
        if "error" in r:
            rows.append([Cell(str(r.get("dtype"))), Cell("—"), Cell("—"), Cell(f"could not replay: {r['error']}")])
            continue
        ok = bool(r.get("loss_finite")) and bool(r.get("grads_finite"))
        rows.append([Cell(str(r.get("dtype"))),
                     Cell(_loss_cell(r), bad=r.get("loss_finite") is False),  # None: not reached
                     Cell(_grads_cell(r), bad=not r.get("grads_finite")),
                     Cell("finite" if ok else "non-finite", bad=not ok)])
    return PrecisionView(rows, precision_sentence(d))


def _loss_cell(r: dict) -> str:
    if r.get("loss") is None and r.get("probe"):
        return "not reached (stopped at the culprit)"
    return num(r.get("loss"))


def _grads_cell(r: dict) -> str:
    if r.get("grads_finite"):
        return "finite"
    if r.get("grads_finite") is None:
        return "not run (the loss is non-finite)"
    if r.get("nonfinite_grads") is not None:
        return f"{num(r['nonfinite_grads'])} non-finite"
    return "non-finite (stopped at the culprit)" if r.get("probe") else "non-finite"


def step_dtype(d: dict) -> str:
    """How the step ran, from the analysis: 'float16', or 'autocast float16'."""
    model = d.get("model") or {}
    ac = model.get("autocast")
    if ac:
        return f"autocast {str(ac.get('dtype') or '').removeprefix('torch.')}".strip()
    dtypes = [str(t) for t in model.get("dtypes") or []]
    return dtypes[0] if len(dtypes) == 1 else (", ".join(dtypes) or "its own dtype")


def precision_sentence(d: dict) -> str:
    """The precision table's own sentence (the one the analysis writes too): it cannot contradict the rows."""
    return sentence_from_rows(d.get("precision") or [], step_dtype(d))


@dataclass
class MachineRow:
    label: str
    captured: str  # what the snapshot recorded when training wrote it
    replayed: str  # where this analysis ran
    differs: bool = False


@dataclass
class EnvironmentView:
    machines: list[MachineRow]  # the training machine (at capture time) beside the replay machine
    captured_note: str  # why a column is empty, where it is
    facts: list[Fact]  # the snapshot and the model


def _dtype_of(d: dict) -> str:
    model = d.get("model") or {}
    dtypes = ", ".join(map(str, model.get("dtypes") or []))
    ac = model.get("autocast")
    if ac:
        dtypes += f" (autocast {ac.get('dtype') or ''})".replace(" )", ")")
    return dtypes or "—"


def machine_rows(d: dict) -> tuple[list[MachineRow], str]:
    """Training machine (what the snapshot recorded at capture time) against the replay machine."""
    env = d.get("environment") or {}
    info = d.get("snapshot_info") or {}
    cap = info.get("environment") if isinstance(info.get("environment"), dict) else {}
    note = "" if cap else ("The snapshot recorded nothing about the machine that wrote it"
                           + (" (a plain state-dict snapshot holds only tensors)." if info.get("format") == "state_dict"
                              else "."))

    def v(x) -> str:
        return "—" if x in (None, "") else str(x)

    world = info.get("world_size")
    rank = info.get("rank")
    ranks = f"rank {v(rank)} of {v(world)}" if world is not None else (f"rank {rank}" if rank is not None else "—")
    rows = [MachineRow("torch", v(cap.get("torch")), v(env.get("torch"))),
            MachineRow("python", v(cap.get("python")), v(env.get("python"))),
            MachineRow("device", v(cap.get("device")) + (f" ({cap['cuda']})" if cap.get("cuda") else ""),
                       v(env.get("device"))),
            MachineRow("dtype", v(cap.get("dtype")), _dtype_of(d)),
            MachineRow("processes", ranks, "1 (the step replays on one process)" if world not in (None, 1) else "1"),
            MachineRow("platform", v(cap.get("platform")), v(env.get("platform")))]
    for r in rows:
        r.differs = r.captured != "—" and r.replayed != "—" and r.label in ("torch", "device", "dtype") and \
            r.captured.split(" ")[0] != r.replayed.split(" ")[0]
    return rows, note


def environment_line(d: dict) -> str:
    """The environment in one line (Markdown summary): what training ran on, what the replay ran on."""
    rows, _ = machine_rows(d)
    by = {r.label: r for r in rows}

    def side(attr: str) -> str:
        parts = [f"torch {getattr(by['torch'], attr)}", getattr(by["device"], attr), getattr(by["dtype"], attr)]
        if attr == "captured" and by["processes"].captured != "—":
            parts.append(by["processes"].captured)
        return ", ".join(p for p in parts if p and "—" not in p)

    cap = side("captured")
    return (f"captured: {cap}; " if cap else "captured: not recorded; ") + f"replayed: {side('replayed')}"


def environment_view(d: dict) -> EnvironmentView:
    machines, note = machine_rows(d)
    return EnvironmentView(machines, note, environment_facts(d))


def environment_facts(d: dict) -> list[Fact]:
    env = d.get("environment") or {}
    model = d.get("model") or {}
    info = d.get("snapshot_info") or {}
    facts = [Fact("snapshot", d.get("snapshot") or "", code=True),
             Fact("snapshot format", str(info.get("format") or "—"))]
    keys = info.get("keys") or {}
    if keys:
        facts.append(Fact("snapshot keys", ", ".join(f"{k} = {v!s}" for k, v in keys.items()), code=True))
    for k, label in (("step", "step"), ("trigger", "trigger"), ("created", "written")):
        if info.get(k) is not None:
            facts.append(Fact(label, num(info[k])))
    facts.append(Fact("model rebuilt from", str(model.get("how") or "—"), code=True))
    if model.get("class"):
        params = f", {model['parameters']:,} parameters" if isinstance(model.get("parameters"), int) else ""
        facts.append(Fact("model", f"{model['class']}{params}"))
    if model.get("dtypes"):
        facts.append(Fact("parameter dtypes", ", ".join(map(str, model["dtypes"]))))
    facts.append(Fact("loss", str(model.get("loss") or "the model's own output (scalar)")))
    if model.get("autocast"):
        facts.append(Fact("autocast", ", ".join(f"{k}={v}" for k, v in model["autocast"].items())))
    if model.get("training") is not None:
        facts.append(Fact("mode", "train()" if model["training"] else "eval()"))
    facts += [Fact("torch", str(env.get("torch") or "—")), Fact("nanreplay", str(d.get("nanreplay_version") or "—"))]
    st = d.get("stats") or {}
    t = (st.get("timings") or {}).get("total")
    if isinstance(t, (int, float)):
        ops = f", {st['ops_forward']} forward ops, {st.get('events', 0)} non-finite events" if "ops_forward" in st else ""
        facts.append(Fact("analysis", f"{t:.2f} s{ops}"))
    return facts


@dataclass
class ReproduceView:
    command: str
    snippet: str
    notes: list[str]


_DOTTED = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")


def reproduce_view(d: dict) -> ReproduceView:
    model = d.get("model") or {}
    env = d.get("environment") or {}
    how = str(model.get("how") or "")
    snap = d.get("snapshot") or "snapshot.pt"
    args = ["nanreplay", "analyze", snap]
    kwargs = [repr(snap)]
    notes = []
    inv = d.get("invocation")
    if inv is None:  # older JSON: reconstruct from how the model was rebuilt
        spec = how[len("--model "):] if how.startswith("--model ") else None
        inv = {"model": spec, "loss": model.get("loss") if spec else None, "trust": "--trust" in how}
    if inv.get("model"):
        args += ["--model", str(inv["model"])]
        kwargs.append(f"model={str(inv['model'])!r}")
        notes.append("Run it where the model's module is importable (the analysis ran with it on the path).")
    if inv.get("trust"):
        args.append("--trust")
        kwargs.append("trust=True")
    if inv.get("loss"):
        args += ["--loss", str(inv["loss"])]
        kwargs.append(f"loss={str(inv['loss'])!r}")
    dev = str(env.get("device") or "cpu")
    if dev != "cpu":
        args += ["--device", dev]
        kwargs.append(f"device={dev!r}")
    args += ["-o", "report.html", "--json", "analysis.json"]
    command = " ".join(shlex.quote(a) for a in args)
    snippet = "\n".join([
        "from nanreplay import analyze",
        "",
        f"a = analyze({', '.join(kwargs)})",
        "print(a.verdict)               # " + d["verdict"],
        "print(a.culprit and a.culprit['op'], a.culprit and a.culprit['source'])",
        "print(a.diagnosis['title'])",
        "print(a.diagnosis['fix']['code'], a.diagnosis['fix']['verified'])",
    ])
    return ReproduceView(command, snippet, notes)
