"""The pieces of an update snapshot's analysis (trigger "update": `optimizer.step()` made the weights
NaN/Inf). `pipeline.py` orchestrates; this module rebuilds the update, checks its leaves, cross-checks
the recorded gradients against the step program, and lays the update out as JSON.

The failure of an update snapshot is the first non-finite parameter after the update; the chain
and the culprit are the events of the replayed `optimizer.step()` (phase "optimizer").
"""

from __future__ import annotations

import torch

from nanreplay import replay, stats
from nanreplay import torch_internals as ti
from nanreplay.analysis.contract import culprit_json, event_json
from nanreplay.enums import Trigger
from nanreplay.formats.base import Snapshot
from nanreplay.formats.rebuild import parse_device
from nanreplay.replay.subject import Subject
from nanreplay.replay.update import UpdateReplay, UpdateSubject, step_bound

NO_ANOMALY = {"raises": None, "node": None, "agrees_with_culprit": None,
              "message": "torch.autograd.set_detect_anomaly(True) does not look inside optimizer.step(): the update "
                         "runs without autograd"}


def is_update(snap: Snapshot) -> bool:
    return snap.format == "native" and snap.trigger == Trigger.UPDATE and snap.raw.get("update") is not None


def subject(snap: Snapshot, device: str | None) -> UpdateSubject:
    """The recorded update of a parsed update snapshot (its `update` field, checked by formats/update_record.py)."""
    u = snap.raw["update"]
    weights = {**(snap.state or {}), **(u.get("extra_weights") or {})}
    names = [n for grp in u["groups"] for n in grp["params"]]
    return UpdateSubject(cls=u["class"], implementation=u["implementation"], groups=u["groups"],
                         weights={n: weights[n] for n in names}, grads=dict(u["gradients"]),
                         state={n: dict(st) for n, st in u["state"].items()}, device=parse_device(device),
                         pre_step=u["pre_step"], lost=dict(u.get("lost") or {}), stand_in=u.get("stand_in"),
                         nonfinite_after=dict(u.get("nonfinite_after") or {}), grad_scale=u.get("grad_scale"),
                         scheduler=u.get("scheduler"), history=list(snap.raw.get("history") or []),
                         notes=list(u.get("notes") or []))


def leaves(us: UpdateSubject) -> list[dict]:
    """NaN/Inf in what the update started from: the weights, the gradients, the optimizer state."""
    rows = []
    for n in us.names:
        w = us.weights[n]
        lost = us.lost.get(n)
        rows.append(stats.leaf_row(n, "parameter", w[~lost] if lost is not None and lost.shape == w.shape else w,
                                   shape=w.shape))
    rows += [stats.leaf_row(n, "gradient", gr) for n, gr in us.grads.items()]
    rows += [stats.leaf_row(f"{n}:{k}", "optimizer_state", v) for n, st in us.state.items() for k, v in st.items()
             if isinstance(v, torch.Tensor)]
    rows = [r for r in rows if r]
    return rows


def memory_bound(us: UpdateSubject) -> int:
    """Peak bytes of a replayed update, bounded from what it holds: weights, gradients and state, plus the copies
    before and after and the optimizer's temporaries — three times over."""
    held = sum(w.numel() * w.element_size() for w in us.weights.values())
    held += sum(gr.numel() * gr.element_size() for gr in us.grads.values())
    held += sum(v.numel() * v.element_size() for st in us.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
    return 3 * held


def forward_check(step_subject: Subject | None, us: UpdateSubject, snap: Snapshot, why: str | None) -> dict:
    """The step program replayed from the weights before the update: its loss, and how its gradients compare
    with the ones the update used (equal when the weights were copied exactly and the step is deterministic)."""
    if step_subject is None:
        return {"replayed": False, "why": why}
    try:
        with replay.anomaly_off():
            if step_subject.prepare is not None:
                step_subject.prepare()
            step_subject.model.zero_grad(set_to_none=True)
            with replay.autocast_from(step_subject.run_autocast):
                loss = step_subject.loss(step_subject.forward())
            loss.backward()
    except Exception as e:  # noqa: BLE001 - a cross-check, not the analysis
        return {"replayed": False, "why": f"replaying the step raised {type(e).__name__}: {str(e)[:200]}"}
    scale = step_subject.loss_scale or 1.0
    worst, equal, compared = 0.0, True, 0
    for n, p in step_subject.model.named_parameters():
        rec = us.grads.get(n)
        if rec is None or p.grad is None or p.grad.shape != rec.shape:
            continue
        got = p.grad.detach().double().cpu() / scale
        want = rec.double()
        compared += 1
        equal = equal and bool(torch.equal(got, want))
        den = float(want.abs().max()) if want.numel() else 0.0
        diff = float((got - want).abs().max()) if want.numel() else 0.0
        worst = max(worst, diff / den if den > 0 else diff)
    step_subject.model.zero_grad(set_to_none=True)
    out = {"replayed": True, "loss": stats._num(float(loss.detach().double()) / scale),
           "loss_recorded": snap.raw.get("loss_value"), "gradients_compared": compared,
           "gradients_equal": equal and compared > 0, "max_relative_difference": worst}
    if snap.raw.get("micro_batch") is not None:
        out["why"] = ("the update used the gradients of every micro-batch; the program holds the last one, so they "
                      "differ by design")
    elif us.pre_step == "reconstructed":
        out["why"] = "the weights were recovered to a rounding step (entries the update overwrote are stand-ins)"
    return out


def parameter_of(upd: UpdateReplay, ev) -> str | None:
    return upd.params_of_ops[ev.fwd] if ev.fwd is not None and ev.fwd < len(upd.params_of_ops) else None


def chain_json(upd: UpdateReplay, chain: list[int]) -> list[dict]:
    return [{**event_json(upd.step, upd.step.events[i]), "parameter": parameter_of(upd, upd.step.events[i])}
            for i in chain]


def culprit(us: UpdateSubject, upd: UpdateReplay, c: int) -> dict:
    """The culprit inside the update, with the parameter and the optimizer state it involved, and their values at
    the entries that broke."""
    ev = upd.step.events[c]
    out = culprit_json(upd.step, ev)
    fail = upd.step.failure
    name = parameter_of(upd, ev) or (fail.name if fail is not None else None)
    info: dict = {"parameter": name, "optimizer": us.cls, "implementation": upd.implementation,
                  "inputs_written_in_place": _written(upd.step.ops[ev.fwd].op) if ev.fwd is not None else []}
    if name is not None and name in upd.after:
        bad = ~torch.isfinite(upd.after[name])
        info["entries"] = int(bad.sum())
        info["first_entries"] = [list(map(int, ix)) for ix in bad.nonzero()[:10].tolist()] if bad.dim() else []
        at: dict[str, dict] = {}
        if bad.any():
            at["weight_before"] = _stats_at(upd.before[name], bad)
            lost = us.lost.get(name)
            if lost is not None and lost.shape == bad.shape:
                at["weight_before"]["stand_ins"] = int((lost & bad).sum())  # not the real weights there
            if name in us.grads:
                at["gradient"] = _stats_at(us.grads[name], bad)
            for k, v in sorted(upd.state_after.get(name, {}).items()):
                if v.shape == bad.shape:
                    at[f"state.{k}"] = _stats_at(v, bad)
        info["at_entries"] = at
        hyper = us.group_of(name)
        info["hyperparameters"] = {k: v for k, v in hyper.items() if k in ("lr", "eps", "betas", "momentum",
                                                                           "weight_decay", "amsgrad", "nesterov")}
        eps, dt = hyper.get("eps"), us.dtype_of(name)
        if isinstance(eps, (int, float)) and dt.is_floating_point:
            info["eps_in_dtype"] = {"dtype": stats.dtype_name(dt), "value": float(torch.tensor(float(eps), dtype=dt))}
    out["update"] = info
    return out


def _written(op) -> list[int]:
    return sorted(ti.op_mutated_args(op)[0])


def _stats_at(t: torch.Tensor, mask: torch.Tensor) -> dict:
    return stats.tensor_stats(t[mask].reshape(-1)) if t.shape == mask.shape else {}


def update_json(us: UpdateSubject, upd: UpdateReplay, check: dict) -> dict:
    """The `update` section of the analysis JSON: what was replayed, from what, and how it compares."""
    replayed = {n: int((~torch.isfinite(a)).sum()) for n, a in upd.after.items()}
    recorded = {n: c["nan"] + c["posinf"] + c["neginf"] for n, c in us.nonfinite_after.items()}
    bound = step_bound(us)
    return {
        "optimizer": us.cls,
        "implementation": us.implementation,
        "implementation_replayed": upd.implementation,
        "groups": [{"params": g["params"], "hyper": g["hyper"]} for g in us.groups],
        "pre_step": us.pre_step,
        "stand_ins": {n: int(m.sum()) for n, m in us.lost.items()},
        "stand_in": us.stand_in,
        "nonfinite_after": {"recorded": recorded, "replayed": {n: k for n, k in replayed.items() if k}},
        "reproduced": {n: k for n, k in replayed.items() if k} == recorded,
        "scheduler": us.scheduler,
        "grad_scale": us.grad_scale,
        "change": upd.change(us.lost),
        "plausible_ratio": 0.5,
        "step_bound": bound[0] if bound else None,
        "step_program": check,
        "notes": us.notes + upd.notes,
    }


def model_info(snap: Snapshot, us: UpdateSubject, why: str | None) -> dict:
    """What the analysis knows of the model when the step itself cannot be rebuilt."""
    info = snap.raw.get("model") or {}
    dtypes = sorted({stats.dtype_name(w.dtype) for w in us.weights.values()})
    return {"how": f"the update record in the snapshot (the step itself: {why})", "class": info.get("class"),
            "parameters": sum(w.numel() for w in us.weights.values()), "dtypes": dtypes,
            "training": snap.raw.get("model_training"), "loss": None, "autocast": None}
