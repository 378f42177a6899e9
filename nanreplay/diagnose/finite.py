"""The replay is finite: why the snapshot was still written, from what the snapshot says about its run.

In order:
* a finite gradient-norm spike (trigger `grad_spike`): which parameters carry it, where backward
  made it grow, which batch samples stand out;
* a distributed run whose gradient failed after the all-reduce: this rank's own step is finite, the
  NaN/Inf came from another rank (`environment.collective.nonfinite_ranks` names it when known);
* a `torch.compile`d run (`environment.compiled`): compiled numerics differ from the eager replay;
* a step with the same batch, weights and random state, no compile, no collective: a likely transient
  fault (hardware or nondeterminism), as large-scale trainers' rerun checks conclude;
* otherwise the honest generic answer.
"""

from __future__ import annotations

import math
import statistics

import torch

from nanreplay import replay, stats
from nanreplay import torch_internals as ti
from nanreplay.diagnose import flow_divergence, flow_prose, vanish_prose
from nanreplay.diagnose.divergence import clip_value, divergence, lr_clip_fix, remedy
from nanreplay.diagnose.model import Fix
from nanreplay.diagnose.plausible import history_rows, norm_squared
from nanreplay.diagnose.site import finite_float
from nanreplay.enums import FixKind
from nanreplay.pytree import iter_tensors
from nanreplay.replay.subject import batch_tensors

GRADIENT_TRIGGERS = ("gradient", "grad_norm_overflow")
HOOKS_NOTE = "backward hooks ran in training that a replay does not run"  # capture/modelstate.py writes it


def _result(cause: str, title: str, explanation: str, fix: Fix, **extra) -> dict:
    return {"cause": cause, "title": title, "explanation": explanation, **extra, "fix": fix.to_json(), "candidates": []}


def _none(guidance: str, verification: str = "not replayed: nothing in this step to change") -> Fix:
    return Fix(FixKind.NONE, "", guidance=guidance, verification=verification)


def diagnose_finite(result, subject, step: replay.Step | None, info: dict, *, verify_fixes: bool = True) -> dict:
    trigger = info.get("trigger")
    env = info.get("environment") if isinstance(info.get("environment"), dict) else {}
    coll = env.get("collective") if isinstance(env.get("collective"), dict) else info.get("collective")
    if not isinstance(coll, dict) and info.get("nonfinite_ranks"):  # the guard's cross-rank agreement saw them
        ranks = [r for r in info["nonfinite_ranks"] if isinstance(r, int) and r != info.get("rank")]
        coll = {"nonfinite_ranks": ranks} if ranks else None
    world = info.get("world_size") if isinstance(info.get("world_size"), int) else 1
    if trigger == "grad_spike" and step is not None:  # during a divergence, the rate is the cause (flow_divergence)
        return flow_divergence.reframe_spike(_spike(result, subject, step, info), info)
    if trigger in flow_prose.FLOW_TRIGGERS:
        return flow_divergence.reframe(flow_prose.diagnose_flow(result, subject, info, verify=verify_fixes), info)
    if trigger == "gradient_vanished":
        return flow_divergence.reframe(vanish_prose.diagnose_vanished(result, step, info), info)
    others = _failed_elsewhere(info)
    if others and trigger in ("loss", *GRADIENT_TRIGGERS):  # written only because the ranks agree at each check
        return _other_rank(result, info, others)
    machine = ((getattr(result, "differential", None) or {}).get("machine") or {})
    if machine.get("verdict") == "transient" and trigger in ("loss", *GRADIENT_TRIGGERS):
        return _transient(result, info, env, machine)  # the guard's own re-run decides it, on the training device
    if trigger == "grad_norm_overflow":
        return _norm_overflow(result, info)
    if trigger in GRADIENT_TRIGGERS and (world > 1 or isinstance(coll, dict)):
        return _from_allreduce(result, info, coll or {})
    d = divergence(info) if trigger in ("loss", *GRADIENT_TRIGGERS) else None
    if d is not None:  # the history climbs (or its learning rate jumped): a run at the edge of float32, not a fault
        return _diverged(result, info, d, machine)
    if env.get("compiled"):
        return _compiled(result, info)
    hooks = next((n for n in info.get("notes") or [] if isinstance(n, str) and n.startswith(HOOKS_NOTE)), None)
    if trigger in GRADIENT_TRIGGERS and hooks:
        return _hooked(result, hooks, machine)
    if trigger in ("loss", *GRADIENT_TRIGGERS) and info.get("format") == "native":
        return _transient(result, info, env)
    return _generic(result)


def _replayed(result) -> str:
    loss = finite_float(getattr(result, "loss", None))
    return f"loss {stats.num(loss)}, every parameter gradient finite" if loss is not None else "every value finite"


def _recorded(info: dict) -> str:
    trig = info.get("trigger")
    if trig == "loss":
        v = info.get("loss_value")
        return f"the run's loss was {stats.num(v)}" if v is not None else "the run's loss was non-finite"
    if trig in GRADIENT_TRIGGERS:
        v = info.get("grad_norm")
        return f"the run's gradient norm was {stats.num(v)}" if v is not None else "the run's gradients were non-finite"
    return "the run failed"


def _from_allreduce(result, info: dict, coll: dict) -> dict:
    ranks = [r for r in coll.get("nonfinite_ranks") or [] if isinstance(r, int)]
    rank = info.get("rank")
    see = f"see rank {', '.join(map(str, ranks))}" if ranks else "see the other ranks' snapshots"
    expl = (f"Not reproduced on this rank: the gradient came non-finite from the all-reduce; {see}. This rank"
            f"{f' ({rank})' if rank is not None else ''} replays its own step finite ({_replayed(result)}), while "
            f"{_recorded(info)} after gradients were averaged across the {info.get('world_size') or 'several'} ranks: "
            "a NaN/Inf on any rank reaches every rank through the all-reduce. Analyze the snapshot of the rank whose "
            "own step fails.")
    return _result("nonfinite_from_allreduce", "non-finite gradient from another rank (all-reduce)", expl,
                   _none(f"analyze the snapshot of the rank whose own gradient is non-finite ({see})"),
                   collective={"nonfinite_ranks": ranks, "rank": rank, "world_size": info.get("world_size")})


def _failed_elsewhere(info: dict) -> list[int]:
    """The ranks that failed, where the guard's rank agreement (`sync_ranks=True`) names them and this rank is not
    among them: its own step was finite, and it wrote the snapshot so that every rank stops at the same step."""
    ranks, rank = info.get("nonfinite_ranks"), info.get("rank")
    if not isinstance(ranks, list) or not isinstance(rank, int) or rank in ranks:
        return []
    return [r for r in ranks if isinstance(r, int)]


def _other_rank(result, info: dict, ranks: list[int]) -> dict:
    names = ", ".join(map(str, ranks))
    see = f"rank {names}" if len(ranks) == 1 else f"ranks {names}"
    expl = (f"This rank ({info.get('rank')}) did not fail: its own step was finite in training, and its replay is "
            f"finite too ({_replayed(result)}). It wrote this snapshot because the ranks agree at each check "
            f"(sync_ranks=True) and {see} went non-finite at this step; every rank stops at the same step so that "
            f"none waits forever in the next collective. Analyze the snapshot {see} wrote of the same step.")
    return _result("failed_on_another_rank", f"finite on this rank: {see} failed", expl,
                   _none(f"analyze the snapshot of {see} (same step)"),
                   collective={"nonfinite_ranks": ranks, "rank": info.get("rank"), "world_size": info.get("world_size")})


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def _norm_overflow(result, info: dict) -> dict:
    """Every gradient entry finite, their float32 norm not: the gradients are astronomically large."""
    d = divergence(info)
    norm = finite_float(info.get("grad_norm"))
    evidence = f"the guard's float64 norm was {norm:.3g}" if norm is not None else "the float32 norm was Inf"
    climb = ""
    if d is not None and d.loss:
        (s0, l0), (s1, l1) = d.loss
        climb = f" The loss climbed from {l0:.3g} (step {s0}) to {l1:.3g} (step {s1})"
    if d is not None and d.grad_norm:
        (g0s, g0), (g1s, g1) = d.grad_norm
        climb += f"{';' if climb else ' The'} gradient norm from about {g0:.3g} to {g1:.3g} (step {g1s})."
    elif climb:
        climb += "."
    expl = (f"Every gradient entry is finite, but the total gradient norm overflowed float32 ({evidence}): the "
            f"gradients are so large that their squares sum past float32's largest value. Training diverged.{climb} "
            f"This step replays finite ({_replayed(result)}); it is not the bug: earlier steps grew the weights and "
            f"activations. {_upper_first(remedy(d) if d else 'lower the learning rate or warm it up, clip gradients')}, "
            "and restart from a checkpoint from before the climb.")
    return _result("training_diverged", "training diverged: the gradient norm overflowed float32", expl,
                   lr_clip_fix(d, info))


def _diverged(result, info: dict, d, machine: dict) -> dict:
    """A finite replay of a run whose history diverged: the values are at the edge of float32's range, where the
    order of a sum decides finite or not. Transient only where a re-run of the same step was finite (above)."""
    again = f" {machine['sentence']}" if machine.get("verdict") == "reproducible" and machine.get("sentence") else ""
    expl = (f"Training diverged: {d.story}. This step replays finite here ({_replayed(result)}), but {_recorded(info)}:"
            f" its values are at the edge of float32's range, where the order of a sum decides whether a gradient "
            f"overflows.{again} The run failed deterministically, not by a fault of the machine: "
            f"{remedy(d)}, and restart from a checkpoint from before step {d.onset}.")
    return _result("training_diverged", "training diverged", expl, lr_clip_fix(d, info), divergence=d.to_json())


def _compiled(result, info: dict) -> dict:
    expl = (f"The step replays finite in eager mode ({_replayed(result)}), but {_recorded(info)} in a "
            "torch.compile'd model: compiled numerics differ from eager (inductor fuses and reorders floating-point "
            "math and draws its own random numbers), so the failure lives in the compiled kernels, which this replay "
            "does not run. Confirm by running the step compiled with backend='aot_eager' (no inductor) or not "
            "compiled at all.")
    return _result("compiled_numerics", "compiled numerics differ from the eager replay", expl,
                   _none("rerun this step with torch.compile(model, backend='aot_eager') or without torch.compile: "
                         "if it is finite there, the fused kernels are at fault (report it, or compile that part "
                         "with a wider dtype)"))


def _hooked(result, note: str, machine: dict) -> dict:
    """A gradient failure the replay does not reproduce, in a step that ran Python backward hooks: the replay
    computes the gradients without them (a program holds no Python), so they are the likeliest source."""
    rerun = f" {machine['sentence']}" if machine.get("verdict") == "reproducible" and machine.get("sentence") else ""
    expl = (f"Not reproduced by the replay ({_replayed(result)}), which computes the gradients without the step's "
            f"Python backward hooks: {note.removeprefix(HOOKS_NOTE + ': ')}.{rerun} What flows back is finite "
            "without them, so the likeliest source of the non-finite gradient is one of those hooks (a gradient "
            "divided by its own norm where that norm is 0, a log or a rescale of it). Check what each computes on "
            "this step's gradients.")
    return _result("not_reproduced", "not reproduced without the step's backward hooks", expl,
                   _none("check the backward hooks named above on this step's gradients (guard a division by a "
                         "gradient's norm with an epsilon)"), evidence=[note, f"this replay: {_replayed(result)}"])


def _transient(result, info: dict, env: dict, machine: dict | None = None) -> dict:
    """A finite replay of a native snapshot's failing step. With the guard's re-run record (differential/machine.py):
    a re-run on the training device that was finite is the evidence itself; one that failed again means the step
    fails there and not here (a device-specific kernel)."""
    machine = machine if machine is not None else ((getattr(result, "differential", None) or {}).get("machine") or {})
    ran_on, here = str(env.get("device") or ""), str((getattr(result, "environment", {}) or {}).get("device") or "")
    same_device = not ran_on or not here or ran_on.split(":")[0] == here.split(":")[0]
    evidence = [f"the same batch, weights and random state as the run, replayed: {_replayed(result)}",
                _recorded(info), "no torch.compile", f"no collective (world size {info.get('world_size') or 1})"]
    verdict = machine.get("verdict")
    if verdict == "transient":
        evidence.insert(0, machine.get("evidence") or "the same step, re-run in the same process on the same device, "
                                                      "was finite")
        same_device = True  # the evidence is from the training device itself
    elif verdict == "reproducible" and not same_device:
        here_name = here or "this machine"
        expl = (f"Not reproduced here, but not transient: {machine.get('sentence', '')} This replay on {here_name} "
                f"is finite ({_replayed(result)}): the step fails on {ran_on or 'the training device'} every "
                f"time and not here — a kernel of that device (or its dtype handling) differs. Replay with --device "
                f"{(ran_on or 'cuda').split(':')[0]} to name the op.")
        return _result("not_reproduced", "reproduced on the training device, not in this replay", expl,
                       _none(f"replay this snapshot with --device {(ran_on or 'cuda').split(':')[0]}"),
                       evidence=[machine.get("sentence", ""), f"this replay: {_replayed(result)}"])
    elif verdict == "inconclusive":
        evidence.append(f"but the guard's re-run was not the same computation ({machine.get('sentence', '')})")
    elif verdict == "reproducible":
        expl = (f"Not reproduced here, but not transient: {machine.get('sentence', '')} This replay on the same kind "
                f"of device is finite ({_replayed(result)}): the failure depends on something the snapshot does not "
                "hold (state outside the model and the batch, a kernel of that very device). nanreplay does not "
                "invent a culprit.")
        return _result("not_reproduced", "reproduced by the guard's re-run, not in this replay", expl,
                       _none("replay on the training machine (--device), or check what the step reads beyond the "
                             "model and the batch"), evidence=[machine.get("sentence", ""), _replayed(result)])
    rows = history_rows(info)
    prev = [v for r in rows if (v := finite_float(r.get("loss"))) is not None]
    loss = finite_float(getattr(result, "loss", None))
    if prev and loss is not None:
        evidence.append(f"the replayed loss sits with the previous steps' ({min(prev):.3g} .. {max(prev):.3g})")
    if not same_device:
        expl = (f"Not reproduced: {'; '.join(evidence)}. But the run was on {ran_on} and this replay on {here}: a "
                f"kernel that differs on {ran_on} (or nondeterminism) can explain it. Replay with --device "
                f"{ran_on.split(':')[0]} to tell a transient fault from a device-specific one.")
        return _result("not_reproduced", "the replay is finite (on another device)", expl,
                       _none(f"replay this snapshot with --device {ran_on.split(':')[0]}"), evidence=evidence)
    if verdict == "transient":
        expl = (f"Transient fault of the machine: {'; '.join(evidence)}. The same computation gave another answer on the "
                "same device: that is hardware (or memory corrupted by other code), not the model. Skip or redo the "
                "step and go on; if it recurs on the same device, check that device (nanreplay triage counts "
                "transient failures per host and device).")
        return _result("transient_fault", "transient fault: the same step re-run on the same device was finite", expl,
                       _none("skip (or redo) this step and continue; if it recurs on the same device, check its "
                             "hardware"), evidence=evidence)
    expl = (f"Likely transient fault (hardware or nondeterminism): {'; '.join(evidence)}. A step that fails once and "
            "is finite when rerun from exactly the same state is what large-scale trainers' rerun checks treat as a "
            "fault of the machine or a nondeterministic kernel, not of the model: skip or redo the step and go on; if "
            "it recurs on the same machine, check that machine.")
    return _result("transient_fault", "likely transient fault (hardware or nondeterminism)", expl,
                   _none("skip (or redo) this step and continue; if it recurs on the same machine, check its hardware"),
                   evidence=evidence)


def _generic(result) -> dict:
    explanation = ("Replaying the snapshot's step gave a finite loss and finite gradients everywhere. "
                   "Either the failure depends on state the snapshot does not hold (RNG for dropout, "
                   "nondeterministic kernels, a different device or dtype), or it happened in a later "
                   "step (e.g. the optimizer update). nanreplay does not invent a culprit.")
    near = [a for a in getattr(result, "activations", []) if a.get("near_overflow")
            and isinstance(a.get("ratio"), float) and isinstance(a.get("absmax"), float)]  # finite: a replay that is
    if near:
        worst = max(near, key=lambda a: a["ratio"] if isinstance(a.get("ratio"), float) else math.inf)
        fmax = torch.finfo(getattr(torch, worst["dtype"])).max
        more = f" (and {len(near) - 1} more)" if len(near) > 1 else ""
        who = f"module {worst['module']!r}" if worst["module"] else "the model"
        explanation += (f" Close to overflow, though: {who}{more} reached "
                        f"|x| = {worst['absmax']:.4g}, {100 * worst['ratio']:.0f}% of {worst['dtype']}'s largest "
                        f"value {fmax:.6g}; slightly larger inputs or weights will overflow. bfloat16 (float32's "
                        "range) or a normalisation before that module gives headroom.")
    return {"cause": "not_reproduced", "title": "the replay is finite", "explanation": explanation,
            "fix": Fix(FixKind.NONE, "# nothing to fix in this step").to_json(), "candidates": []}


# ------------------------------------------------------------------ a finite gradient-norm spike


def _spike(result, subject, step: replay.Step, info: dict) -> dict:
    sq = {g["name"]: v for g in step.grads if g.get("has_grad") and (v := _norm_squared(g)) is not None}
    total = sum(sq.values())
    norm = math.sqrt(total) / (subject.loss_scale or 1.0)
    recorded = finite_float(info.get("grad_norm"))
    reproduced = recorded is not None and recorded > 0 and abs(norm - recorded) <= 1e-3 * recorded
    before = [v for r in history_rows(info) if (v := finite_float(r.get("grad_norm"))) is not None]
    med = statistics.median(before) if before else None
    carriers = [{"name": n, "grad_norm": math.sqrt(v), "share": v / total if total else None}
                for n, v in sorted(sq.items(), key=lambda nv: -nv[1])[:5]]
    growth = _backward_growth(subject, step)
    outliers = _outlier_samples(subject)
    spike = {"grad_norm": norm, "median_before": med, "factor": norm / med if med else None,
             "recorded_grad_norm": recorded, "reproduced": reproduced, "carriers": carriers,
             "backward_growth": growth, "outlier_samples": outliers}
    parts = [f"The gradient norm of this step is {norm:.4g}"
             + (f", {norm / med:.3g}× the median of the previous steps ({med:.3g})" if med else "")
             + " — finite, a spike rather than a failure"
            + (" (reproduced: the run recorded the same norm)." if reproduced else
               f" (the run recorded {recorded:.4g})." if recorded is not None else ".")]
    shown = [c for c in carriers[:3] if c["share"] is not None and c["share"] >= 0.01]
    if shown:
        parts.append("It sits in " + ", ".join(f"{c['name']} ({100 * c['share']:.0f}% of the squared norm)"
                                                for c in shown) + ".")
        op = _op_of(step, carriers[0]["name"].rpartition(".")[0])
        if op:
            spike["carrier_op"] = op
            src = op.get("source")
            at = f" at {src['file']}:{src['line']}" if src else ""
            parts.append(f"That gradient is {op['op']}'s, in module {op['module'] or '<root>'!r}{at}.")
    if growth and growth["factor"] > 1.5:
        src = growth.get("source")
        at = f" at {src['file']}:{src['line']}" if src else ""
        parts.append(f"In backward the gradient grew most through module {growth['module']!r} ({growth['op']}{at}): "
                     f"the gradient it passed on is {growth['factor']:.3g}× the one it received.")
    if outliers:
        o = outliers[0]
        parts.append(f"Batch sample(s) {o['samples']} of {o['name']} stand out: |x| up to {o['absmax']:.3g} against a "
                     f"median of {o['median']:.3g} over the batch — a spike like this usually comes from such a batch.")
    clip = clip_value(2 * med) if med else None
    guide = ["clip the gradient norm to keep one batch from moving the weights this far:",
             f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={clip:g})"
             + (f"  (twice the recent median {med:.3g})" if med else "") if clip else
             "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=...)  (about the usual gradient norm)"]
    if outliers:
        guide.append(f"and look at batch sample(s) {outliers[0]['samples']}: they are far outside the rest")
    fix = Fix(FixKind.LOWER_LR_CLIP_GRADS, "", guidance="\n".join(guide),
              verification="not replayed: clipping changes the update, not this step's gradients",
              reasoning="numbers from the snapshot's history" if med else "")
    return _result("grad_spike", "a finite gradient-norm spike", " ".join(parts), fix, spike=spike)


def _norm_squared(g: dict) -> float | None:
    """‖g‖² of every parameter: a one-element gradient (a bias, a scale) has no std, its square is its mean's."""
    if math.prod(g.get("shape") or [1]) == 1:
        m = finite_float(g.get("mean"))
        return m * m if m is not None else None
    return norm_squared(g)


def _backward_growth(subject, step: replay.Step) -> dict | None:
    """The leaf module whose backward made the gradient grow the most (‖grad in‖ / ‖grad out‖), on a copy."""
    try:
        copy = subject.converted()
        names = {id(m): n for n, m in copy.model.named_modules() if n and not any(True for _ in m.children())}
        acc: dict[str, list[float]] = {}

        def add(name: str, slot: int, g: torch.Tensor) -> None:
            row = acc.setdefault(name, [0.0, 0.0])
            row[slot] += float(g.detach().double().pow(2).sum())

        def pre(mod, args):
            n = names.get(id(mod))
            for _, t in iter_tensors(args) if n else ():
                if t.requires_grad and t.is_floating_point():
                    t.register_hook(lambda g, n=n: add(n, 0, g))

        def post(mod, args, out):
            n = names.get(id(mod))
            for _, t in iter_tensors(out) if n else ():
                if t.requires_grad and t.is_floating_point():
                    t.register_hook(lambda g, n=n: add(n, 1, g))
        handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                   torch.nn.modules.module.register_module_forward_hook(post)]
        try:
            if copy.prepare is not None:
                copy.prepare()
            with replay.anomaly_off(), replay.autocast_from(copy.autocast):
                loss = copy.loss(copy.forward())
            loss.backward()
        finally:
            for h in handles:
                h.remove()
    except Exception:  # noqa: BLE001 - an extra, never a reason to fail the analysis
        return None
    rows = [(n, math.sqrt(i / o)) for n, (i, o) in acc.items() if o > 0 and i > 0 and math.isfinite(i / o)]
    if not rows:
        return None
    name, factor = max(rows, key=lambda r: r[1])
    op = _op_of(step, name) or {"op": None, "source": None}
    return {"module": name, "factor": factor, "op": op["op"], "source": op["source"]}


def _op_of(step: replay.Step, module: str) -> dict | None:
    """The first op that computes something (not a view) in `module`, with its line."""
    rec = next((r for r in step.ops if r.module == module and not ti.op_is_view(r.op)), None)
    if rec is None:
        return None
    return {"op": str(rec.op), "module": module, "source": replay.frame_json(rec.frame)}


def _outlier_samples(subject, ratio: float = 10.0) -> list[dict]:
    """Batch samples (along dim 0) whose largest |value| is `ratio` times the batch's median sample."""
    out = []
    for name, role, t in batch_tensors(subject):
        if role not in ("input", "target") or not t.is_floating_point() or t.dim() == 0 or t.shape[0] < 3:
            continue
        per = t.detach().reshape(t.shape[0], -1).abs().amax(dim=1).double()
        med = float(per.median())
        if med <= 0 or not stats.finite_fast(per):
            continue
        idx = (per > ratio * med).nonzero().flatten().tolist()
        if idx:
            out.append({"name": name, "role": role, "samples": idx[:10], "absmax": float(per.max()), "median": med})
    return out
