"""The compiler: a `torch.compile`d step whose eager replay is finite, replayed compiled.

    attach(result, subject, verify=True)   # where the diagnosis is `compiled_numerics`: result.differential["compiler"]

The question arises only where the finite-replay diagnosis says `compiled_numerics` (the run was compiled, the
eager replay is finite: diagnose/finite.py) — never on a plain culprit (an eager replay that fails answers "your
code" by itself). Then, on independent copies of the step program (regions.py):

1. the step eager (this pass's baseline), compiled with `BACKEND` (inductor, on this CPU) and with `CONTROL`
   (aot_eager: the same graph capture and autograd, no inductor codegen) — loss and gradients of each;
2. where the compiled step is non-finite and eager is not: module-call segments (formats/segments.py) compiled one
   at a time, the rest eager, from the outermost calls inward — the smallest call that reproduces it alone is the
   region; where none does alone, the region is the whole step (the fusion across calls matters);
3. fix candidates, each a real replay: the whole step compiled with that region computed in a wider dtype; the
   whole step compiled except that region (what `torch.compiler.disable` on it does: it runs eagerly, a graph
   break on either side); the control backend (its replay is step 1's).

Skipped with one line where it cannot run here: no step program, no C++ compiler, inductor does not import, the
confined child holds no scratch folder to compile in (confine/ then reruns the analysis in a child that has one:
docs/trust.md), or the compile itself fails. Verdicts: `compiled_numerics_confirmed`, `not_reproduced_compiled`,
`control_nonfinite` (aot_eager fails too: not inductor's kernels), `eager_nonfinite`, `skipped`.
"""

from __future__ import annotations

import importlib
import os
import shutil
import time
from typing import Any

import torch

from nanreplay.differential import regions as rg
from nanreplay.errors import raised
from nanreplay.formats import segments as seg_mod
from nanreplay.limits import release_memory
from nanreplay.numbers import num

QUESTION = ("the run was torch.compile'd and its eager replay is finite: is the step non-finite compiled, and in "
            "which compiled region?")
BACKEND: Any = "inductor"  # a backend name or callable (tests register a perturbing one)
CONTROL = "aot_eager"
MAX_COMPILED_REPLAYS = 24  # the bisection's budget (the command's --timeout bounds it too)
SANDBOX = {"confined": False, "scratch": None}  # set by the confined child (confine/child.py) before it analyzes
SANDBOX_NEEDED = "sandbox"  # `skipped_for`: this child cannot compile; a child with a scratch folder can

CONFIRMED, NOT_REPRODUCED, CONTROL_BAD, EAGER_BAD, SKIPPED = ("compiled_numerics_confirmed", "not_reproduced_compiled",
                                                              "control_nonfinite", "eager_nonfinite", "skipped")


def applies(result) -> bool:
    return (result.diagnosis or {}).get("cause") == "compiled_numerics"


def attach(result, subject, *, verify: bool = True) -> None:
    """Run the pass where its question arises; its record lands in `result.differential["compiler"]` and, where it
    decides the diagnosis, the diagnosis is written from its evidence."""
    if not applies(result):
        return
    d = run(subject, verify=verify)
    result.differential = {**(result.differential or {}), "compiler": d}
    result.diagnosis = diagnosis(result.diagnosis, d)


def _name(backend: Any) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


def unavailable(subject, backend: Any) -> tuple[str | None, str | None]:
    """(why not, its kind) where this replay cannot run here; (None, None) where it can."""
    if not getattr(subject, "program", False) or getattr(getattr(subject, "model", None), "program", None) is None:
        return "the snapshot holds no step program to compile (it was rebuilt from a model)", "program"
    if SANDBOX["confined"] and not SANDBOX["scratch"]:
        return ("the confined analysis has no folder to compile in (an inductor compile writes its kernels and runs "
                "a C++ compiler)", SANDBOX_NEEDED)
    if backend == "inductor":
        cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
        if not cxx or not shutil.which(cxx):
            return "no C++ compiler here (inductor's CPU kernels need g++ or clang++; set CXX)", "toolchain"
        try:
            importlib.import_module("torch._inductor.compile_fx")
        except Exception as e:  # noqa: BLE001 - any import failure is the same answer
            return f"torch's inductor does not import here: {raised(e)}", "inductor"
    return None, None


def run(subject, *, verify: bool = True, backend: Any = None) -> dict:
    backend = BACKEND if backend is None else backend
    t0 = time.perf_counter()
    out: dict = {"question": QUESTION, "ran": [], "verdict": SKIPPED, "sentence": "", "skipped": None, "seconds": 0.0,
                 "backend": _name(backend), "control": CONTROL, "region": None, "fixes": [], "compiled_replays": 0}
    why, kind = unavailable(subject, backend)
    if why:
        out.update(skipped=why, skipped_for=kind, sentence=f"Not replayed compiled here: {why}.")
        out["seconds"] = time.perf_counter() - t0
        return out
    p = _Pass(subject, backend, out)
    try:
        p.answer(verify)
    except _Budget:
        pass
    except Exception as e:  # noqa: BLE001 - a compile that fails is an answer (skipped), never a failed analysis
        out.update(verdict=SKIPPED, skipped=f"the compiled replay raised {raised(e)}", skipped_for="compile")
        out["sentence"] = f"Not replayed compiled here: {out['skipped']}."
    finally:  # the compiled graphs go with their GraphModules (dynamo's caches hang on their code); the caller's
        release_memory()  # own compiled models are left alone: no torch.compiler.reset()
    out["seconds"] = time.perf_counter() - t0
    return out


class _Budget(Exception):  # noqa: N818 - the bisection's budget is spent: what was found stands
    pass


class _Pass:
    def __init__(self, subject, backend: Any, out: dict):
        self.subject, self.backend, self.out = subject, backend, out
        self.model = subject.model
        self.program = subject.model.program
        self.n = len(self.program.nodes)

    # ---- one replay, recorded
    def _replay(self, what: str, where: str, compiled: dict[rg.Region, tuple[Any, Any]]) -> dict:
        """`compiled`: region -> (backend, wide dtype or None)."""
        if self.out["compiled_replays"] >= MAX_COMPILED_REPLAYS and compiled:
            raise _Budget
        fns = {}
        for (a, b), (backend, wide) in compiled.items():
            gm = rg.region_graph(self.model, a, b, wide=wide[0] if wide else None, wide_range=wide[1] if wide else None)
            fns[(a, b)] = torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)
        t = time.perf_counter()
        row = {"what": what, "where": where, **rg.replay(self.subject, fns), "seconds": 0.0}
        row["seconds"] = time.perf_counter() - t
        row["finite"] = bool(row["loss_finite"] and row["grads_finite"])
        self.out["ran"].append(row)
        self.out["compiled_replays"] += 1 if compiled else 0
        release_memory()
        return row

    def _try(self, what: str, where: str, compiled: dict) -> dict:
        """A replay whose compile may fail without ending the pass: the row then says what was raised."""
        try:
            return self._replay(what, where, compiled)
        except _Budget:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a region dynamo cannot capture whole
            row = {"what": what, "where": where, "loss": None, "loss_finite": None, "grads_finite": None,
                   "nonfinite_grads": None, "first_nonfinite_grad": None, "grad_norm": None, "seconds": 0.0,
                   "finite": None, "error": raised(e)}
            self.out["ran"].append(row)
            return row

    def answer(self, verify: bool) -> None:
        out, whole = self.out, (0, self.n)
        eager = self._replay("eager", "the whole step", {})
        comp = self._replay(f"compiled ({out['backend']})", "the whole step", {whole: (self.backend, None)})
        ctrl = self._try(f"compiled ({CONTROL})", "the whole step", {whole: (CONTROL, None)})
        for row in (comp, ctrl):
            row["vs_eager"] = _vs(row, eager)
        if not eager["finite"]:
            out["verdict"] = EAGER_BAD
            out["sentence"] = (f"This pass's eager replay is not finite ({_state(eager)}), unlike the analysis's: the "
                               "step is not deterministic here; no compiled verdict is drawn.")
            return
        if comp["finite"]:
            out["verdict"] = NOT_REPRODUCED
            out["sentence"] = (f"Not reproduced compiled either: the step compiled with {out['backend']} on this CPU is "
                               f"finite ({_state(comp)}; eager {_state(eager)}), and with {CONTROL} too"
                               f"{'' if ctrl['finite'] else ' (not: ' + _state(ctrl) + ')'}. The run's failure needs the "
                               "kernels of the device it ran on, or a nondeterministic one.")
            return
        region = self.bisect()
        out["region"] = region
        if ctrl["finite"] is False:
            out["verdict"] = CONTROL_BAD
        else:
            out["verdict"] = CONFIRMED
        if verify:
            out["fixes"] = self.candidates(region, ctrl)
        out["sentence"] = _sentence(out, eager, comp, ctrl)

    # ---- the bisection
    def bisect(self) -> dict:
        """From the outermost module calls inward: the first call whose segment compiled alone reproduces the
        failure, then the same among its own calls (and its own ops outside them), until none does alone."""
        prog = self.program
        units = {m for m in prog.modules if m and m != "<loss>"}
        level, parent, best = seg_mod.plan(prog, units), None, None
        try:
            while level:
                hit = None
                for s in level:
                    span = (s.start, s.stop)
                    if s.stop <= s.start or rg.compilable(prog, *span) or span == (0, self.n) or \
                            (best is not None and span == (best.start, best.stop)):
                        continue
                    unit, own = (s.unit, False) if s.unit else (parent, parent is not None)
                    row = self._try(f"compiled ({self.out['backend']})", _where(prog, *span, unit, own),
                                    {span: (self.backend, None)})
                    if row["finite"] is False:
                        hit = (s, unit, own)
                        break
                if hit is None:
                    break
                best, parent = hit[0], hit[1]
                best_at = hit
                level = hit[0].children if hit[0].unit else []
        except _Budget:
            pass
        if best is None:
            return _region(prog, 0, self.n, None, alone=False)
        s, unit, own = best_at
        return _region(prog, s.start, s.stop, unit, alone=True, own=own)

    # ---- the fixes, each replayed
    def candidates(self, region: dict, ctrl: dict) -> list[dict]:
        a, b = region["nodes"]
        whole = (0, self.n)
        wide = rg.wider(self.subject.step_dtype())
        wname = str(wide).replace("torch.", "")
        who = f"module {region['module']!r}" if region["module"] else "the step"
        fixes = []
        try:  # the concrete change first: its code is exact (the wider-dtype one says what to change, in words)
            if (a, b) != whole and region["module"]:
                parts = {r: (self.backend, None) for r in ((0, a), (b, self.n)) if r[1] > r[0]}
                row = self._try(f"compiled ({self.out['backend']}) except {who}", region["where"], parts)
                fixes.append(_fix("compiler_disable", f"torch.compiler.disable on {who} (it runs eagerly)", row,
                                  _disable_code(region)))
            row = self._try(f"compiled ({self.out['backend']}), {who} in {wname}", region["where"],
                            {whole: (self.backend, (wide, (a, b)))})
            fixes.append(_fix("wider_dtype", f"compute {who} in {wname} inside the compiled model", row,
                              _wide_code(region, wname)))
        except _Budget:
            pass
        fixes.append(_fix("backend", f"compile with backend={CONTROL!r}", ctrl,
                          f"model = torch.compile(model, backend={CONTROL!r})"))
        return fixes


def _fix(kind: str, label: str, row: dict, code: str) -> dict:
    return {"kind": kind, "label": label, "code": code, "verified": bool(row["finite"]), "replay": row["what"],
            "loss": row["loss"], "grad_norm": row["grad_norm"],
            "verification": f"replayed {row['what']}: {_state(row)}"}


def _wide_code(region: dict, wname: str) -> str:
    m = region["module"]
    if not m:
        return f"# run the compiled step in torch.{wname} (model and batch), or keep this computation out of the graph"
    return (f"# in module {m!r}'s forward, compute in torch.{wname} and cast the result back:\n"
            f"#     out = <its computation on x.to(torch.{wname})>.to(x.dtype)")


def _disable_code(region: dict) -> str:
    return (f"m = model.get_submodule({region['module']!r})  # keep this call out of the compiled graph\n"
            "m.forward = torch.compiler.disable(m.forward)")


def _state(row: dict) -> str:
    if row.get("error"):
        return f"could not be compiled: {row['error']}"
    if not row["loss_finite"]:
        return f"loss {num(row['loss'])}"
    if not row["grads_finite"]:
        return f"loss {num(row['loss'])}, {row['nonfinite_grads']} non-finite gradient(s) (first {row['first_nonfinite_grad']})"
    return f"loss {num(row['loss'])}, every gradient finite"


def _vs(row: dict, eager: dict) -> dict:
    """How far a compiled replay is from eager: relative difference of the loss and of the gradient norm."""
    def rel(x, y):
        if not isinstance(x, float) or not isinstance(y, float) or not (row["finite"] and eager["finite"]):
            return None
        return abs(x - y) / max(abs(y), 1e-30)
    return {"loss_rel": rel(row["loss"], eager["loss"]), "grad_norm_rel": rel(row["grad_norm"], eager["grad_norm"])}


def _where(prog, a: int, b: int, unit: str | None, own: bool = False) -> str:
    nodes = f"node {a}" if b - a == 1 else f"nodes {a}-{b - 1}"
    if own:
        return f"module {unit!r}'s own ops ({nodes}, outside its submodules' calls)"
    return f"module {unit!r} ({nodes})" if unit else f"{nodes} (outside any module call)"


def _region(prog, a: int, b: int, unit: str | None, *, alone: bool, own: bool = False) -> dict:
    """The region as the JSON holds it: its module, nodes, the ops it computes (views aside) and the first line."""
    from nanreplay import torch_internals as ti

    ops: dict[str, int] = {}
    source = None
    for node in prog.nodes[a:b]:
        if ti.op_is_view(node.op):
            continue
        ops[node.name] = ops.get(node.name, 0) + 1
        if source is None and node.frame is not None:
            f = prog.frames[node.frame]
            source = {"file": f.get("file"), "line": f.get("line"), "code": f.get("code")}
    where = _where(prog, a, b, unit, own) if alone else "the whole step"
    return {"module": unit, "nodes": [a, b], "where": where, "alone": alone, "ops": list(ops)[:12],
            "op_counts": ops, "source": source}


def _sentence(out: dict, eager: dict, comp: dict, ctrl: dict) -> str:
    r = out["region"]
    be = out["backend"]
    ops = ", ".join(r["ops"][:6]) or "no compute op"
    where = (f"{r['where']} compiled alone (the rest eager) reproduces it; its ops: {ops}" if r["alone"] else
             f"no single module call reproduces it compiled alone: the fusion across the whole step does ({ops}, ...)")
    if out["verdict"] == CONTROL_BAD:
        head = (f"Non-finite compiled, with {be} and with {CONTROL} too ({_state(ctrl)}), while eager is finite "
                f"({_state(eager)}): graph capture or torch's decompositions change the numerics, not only {be}'s "
                "kernels")
    else:
        head = (f"Compiled numerics confirmed: the step compiled with {be} is non-finite ({_state(comp)}) where eager "
                f"({_state(eager)}) and {CONTROL} ({_state(ctrl)}) are finite")
    good = next((f for f in out["fixes"] if f["verified"]), None)
    tail = f" Verified fix: {good['label']} ({good['verification']})." if good else (
        " No candidate fix replayed finite." if out["fixes"] else "")
    return f"{head}; {where}.{tail}"


def diagnosis(diag: dict, d: dict) -> dict:
    """The diagnosis where this pass decided it: the cause's explanation and its fix from the evidence."""
    diag = dict(diag or {})
    if d["verdict"] not in (CONFIRMED, CONTROL_BAD):
        if d.get("sentence"):
            diag["explanation"] = f"{diag.get('explanation', '')} {d['sentence']}".strip()
        return diag
    from nanreplay.diagnose.model import Fix
    from nanreplay.enums import FixKind

    r = d["region"]
    fixes = d["fixes"]
    good = next((f for f in fixes if f["verified"]), None)
    diag["title"] = (f"compiled numerics: {d['backend']}'s kernels for {r['where']} make the step non-finite"
                     if d["verdict"] == CONFIRMED else "compiled numerics: non-finite under graph capture (aot_eager too)")
    diag["explanation"] = d["sentence"]
    diag["confirmed_by"] = "differential.compiler"

    def fix_json(f: dict) -> dict:
        fx = Fix(FixKind.COMPILER, f["code"], verified=f["verified"], verification=f["verification"],
                 reasoning=f["label"], tested_as="step")
        fx.replay = {"loss": f["loss"], "grad_norm": f["grad_norm"], "plausible": None,
                     "why": "a compiled replay of the step"}
        return fx.to_json()

    if good is not None:
        diag["fix"] = fix_json(good)
    diag["candidates"] = [fix_json(f) for f in fixes]
    return diag
