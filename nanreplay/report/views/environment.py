"""How the step was run and how to run it again: the precision probe, the environment, the reproduce commands."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

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
                     Cell(num(r.get("loss")), bad=not r.get("loss_finite")),
                     Cell("finite" if r.get("grads_finite") else f"{num(r.get('nonfinite_grads'))} non-finite",
                          bad=not r.get("grads_finite")),
                     Cell("finite" if ok else "non-finite", bad=not ok)])
    sentence = (d.get("diagnosis") or {}).get("precision") or ""
    return PrecisionView(rows, sentence)


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
    if info.get("rank") is not None or info.get("world_size") is not None:
        facts.append(Fact("rank", f"{num(info.get('rank'))} of {num(info.get('world_size'))}"
                          if info.get("world_size") is not None else num(info.get("rank"))))
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
    facts += [Fact("device", str(env.get("device") or "—")), Fact("torch", str(env.get("torch") or "—")),
              Fact("python", str(env.get("python") or "—")), Fact("platform", str(env.get("platform") or "—")),
              Fact("nanreplay", str(d.get("nanreplay_version") or "—"))]
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
