"""A snapshot taken one step late: the loss or a gradient went NaN because the *previous* update had already
written NaN/Inf into the weights. Nothing of that update can be replayed (the snapshot holds the weights
after it, not before, and not its gradients), but the optimizer state the snapshot holds is the state that
update left, so it still says which parameters and entries broke and, most likely, why:

* a learning rate that is NaN/Inf (a scheduler);
* optimizer state that is NaN/Inf at the broken entries;
* an eps the state's dtype rounds to 0 next to a second moment of 0 at the broken entries (Adam + .half());
* weights at the edge of the dtype's range next to Inf entries (an update that overflowed).

`late_update(rows, snap)` returns the diagnosis, or None when the snapshot holds no optimizer state to read.
Everything read from the snapshot's optimizer record is checked here first (it is data from a file).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanreplay import stats
from nanreplay.diagnose.model import Fix
from nanreplay.diagnose.update_site import denominator_key, g
from nanreplay.enums import FixKind
from nanreplay.formats import schema as S

NOT_VERIFIED = ("not verified: this snapshot was written one step after the update that broke the weights, so it "
                "holds neither the weights before that update nor its gradients. NanGuard checks the weights right "
                "after optimizer.step() (check_update=True, the default) and its update snapshot replays and verifies "
                "the fix.")

_GROUP = S.record({"params": S.list_of(S.integer(0, 10**9))}, required=("params",))


def _state_value(v: Any, where: str) -> Any:
    if isinstance(v, torch.Tensor):
        return S.tensor()(v, where)
    return S.number(v, where)


_STATE = S.dict_of(S.dict_of(_state_value, limit=32), key=S.integer(0, 10**9))


def read_optimizer(raw: dict) -> tuple[str, list[dict], dict[str, dict], dict[str, dict]] | None:
    """(class, groups, state by parameter name, hyperparameters by parameter name) from a snapshot's optimizer
    record, checked; None when it holds no usable state."""
    upd = raw.get("update")
    if isinstance(upd, dict) and upd.get("pre_step") == "post_step":  # an update snapshot that could not be inverted
        hyper = {n: grp["hyper"] for grp in upd["groups"] for n in grp["params"]}
        return upd["class"], upd["groups"], upd["state"], hyper
    opt = raw.get("optimizer") or {}
    sd = opt.get("state_dict")
    if not isinstance(sd, dict):
        return None
    try:
        groups_raw = S.list_of(lambda v, w: v, 10_000)(sd.get("param_groups"), "param_groups")
        groups = []
        for i, grp in enumerate(groups_raw):
            ids = _GROUP(grp, f"param_groups[{i}]")["params"]
            hyper = {k: S.plain_value(v, f"param_groups[{i}].{k}") for k, v in grp.items()
                     if isinstance(k, str) and k != "params" and not isinstance(v, torch.Tensor)}
            groups.append({"params": ids, "hyper": hyper})
        state = _STATE(sd.get("state") or {}, "state")
    except S.SchemaError:
        return None
    order = [i for grp in groups for i in grp["params"]]
    names = opt.get("param_names") or []
    if len(names) != len(order) or not all(names):
        names = _positional_names(raw, order, state)
        if names is None:
            return None
    by_index = dict(zip(order, names, strict=True))
    state_by = {by_index[i]: st for i, st in state.items() if i in by_index}
    hyper_by = {by_index[i]: grp["hyper"] for grp in groups for i in grp["params"] if i in by_index}
    return str(opt.get("class") or "the optimizer"), groups, state_by, hyper_by


def _positional_names(raw: dict, order: list[int], state: dict) -> list[str] | None:
    """Older snapshots: the optimizer's parameters in the model's order, when every shape agrees."""
    params = raw.get("parameters") or []
    weights = raw.get("state") or {}
    if len(params) != len(order):
        return None
    for i, n in zip(order, params, strict=True):
        w = weights.get(n)
        for v in (state.get(i) or {}).values():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and (w is None or v.shape != w.shape):
                return None
    return list(params)


def late_update(rows: list[dict], snap: Any) -> dict | None:
    """The diagnosis of a snapshot whose weights were already NaN/Inf: the previous update, named precisely."""
    read = read_optimizer(snap.raw)
    weights = snap.state or {}
    broken = [r for r in rows if r.get("role") == "parameter" and isinstance(weights.get(r["name"]), torch.Tensor)]
    if read is None or not broken:
        return None
    cls, groups, state, hyper = read
    facts = []
    for r in broken:
        w = weights[r["name"]]
        bad = ~torch.isfinite(w)
        first = [list(map(int, ix)) for ix in bad.nonzero()[:5].tolist()] if w.dim() else []
        facts.append((r["name"], w, bad, first))
    listing = "; ".join(f"{n}: {int(b.sum())} of {w.numel()} entries ({int(torch.isnan(w).sum())} NaN, "
                        f"{int(torch.isinf(w).sum())} Inf; first at {first})" for n, w, b, first in facts[:5])
    more = f"; and {len(facts) - 5} more parameters" if len(facts) > 5 else ""
    head = (f"The weights were already NaN/Inf when this step began: the previous {cls} update wrote them — "
            f"{listing}{more}. ")
    cause = (_lr(groups, cls, snap.raw.get("history") or [], snap.raw.get("step")) or _state(facts, state, cls)
             or _eps(facts, state, hyper, cls) or _overflow(facts, hyper, cls))
    if cause is None:
        return {"cause": "nonfinite_parameters", "title": f"the previous {cls} update broke the weights",
                "explanation": head + "Its optimizer state shows none of the usual causes (a NaN/Inf learning rate, "
                               "NaN/Inf state, an eps the dtype rounds to 0, an overflow of the dtype's range). "
                               "Restore the last good checkpoint and let NanGuard catch the update itself.",
                "fix": Fix(FixKind.RESTORE_PARAMETERS, "model.load_state_dict(torch.load('last_good.pt'))",
                           verification=NOT_VERIFIED).to_json(), "candidates": []}
    name, title, why, fix = cause
    fix.verification = NOT_VERIFIED
    return {"cause": name, "title": f"the previous update broke the weights: {title}",
            "explanation": head + "Most likely cause, from the optimizer state this snapshot holds: " + why,
            "fix": fix.to_json(), "candidates": [], "late": True}


def _lr(groups: list[dict], cls: str, history: list[dict], step: Any):
    bad = [(i, grp["hyper"].get("lr")) for i, grp in enumerate(groups)
           if isinstance(grp["hyper"].get("lr"), float) and not math.isfinite(grp["hyper"]["lr"])]
    listed = ", ".join(f"group {i}: lr = {lr}" for i, lr in bad)
    if not bad:  # the schedule may have moved on since: the learning rates the guard logged for earlier steps
        logged = [(r.get("step"), r["lr"]) for r in history if isinstance(r.get("lr"), float)
                  and not math.isfinite(r["lr"]) and (not isinstance(step, int) or r.get("step") != step)]
        if not logged:
            return None
        listed = ", ".join(f"lr = {lr} at step {s}" for s, lr in logged[-3:]) + " (the guard's history)"
    return ("nonfinite_lr", "the learning rate is NaN/Inf (scheduler)",
            f"the learning rate is not finite ({listed}), and {cls} multiplies every step by it. A scheduler "
            "(or code that sets param_groups' lr) produced it: check its factor at this epoch.",
            Fix(FixKind.LR_SCHEDULE, "assert all(math.isfinite(lr) for lr in scheduler.get_last_lr())"))


def _state(facts, state: dict, cls: str):
    hits = []
    for n, _, bad, _ in facts:
        for k, v in (state.get(n) or {}).items():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == bad.shape:
                k_bad = int((~torch.isfinite(v) & bad).sum())
                if k_bad:
                    hits.append((n, k, k_bad))
    if not hits:
        return None
    listed = ", ".join(f"{k} of {n} ({c} entries)" for n, k, c in hits[:5])
    names = sorted({n for n, *_ in hits})
    return ("nonfinite_optimizer_state", "the optimizer state is NaN/Inf",
            f"the {cls} state is NaN/Inf at the same entries: {listed}. Either the state broke first (a checkpoint "
            "saved after a bad step, state from another run) and the update carried it into the weights, or one "
            "update wrote both; restore both from the last good checkpoint.",
            Fix(FixKind.RESTORE_OPTIMIZER_STATE,
                "model.load_state_dict(ckpt['model']); optimizer.load_state_dict(ckpt['optimizer'])  # last good\n"
                f"# or reset the broken state: for name in {names!r}: optimizer.state[params[name]].clear()"))


def _eps(facts, state: dict, hyper: dict, cls: str):
    for n, _w, bad, _ in facts:
        h = hyper.get(n) or {}
        eps, key = h.get("eps"), denominator_key(cls, h)
        v = (state.get(n) or {}).get(key) if key else None
        if not isinstance(eps, (int, float)) or not isinstance(v, torch.Tensor) or not v.is_floating_point() \
                or v.shape != bad.shape or eps <= 0:
            continue
        fi = torch.finfo(v.dtype)
        in_dtype = float(torch.tensor(float(eps), dtype=v.dtype))
        at = v[bad]
        zeros = int((at == 0).sum())
        if (in_dtype == 0.0 or eps < fi.tiny) and at.numel() and zeros * 2 >= at.numel():
            dt = stats.dtype_name(v.dtype)
            e = 10.0 ** math.ceil(math.log10(fi.tiny))
            return ("optimizer_eps", f"{cls} eps below {dt}'s resolution",
                    f"{cls}'s eps = {g(float(eps))} {'rounds to 0' if in_dtype == 0 else 'is subnormal'} in {dt} "
                    f"(smallest positive number {g(fi.tiny * fi.eps)}), and at {zeros} of the {at.numel()} broken "
                    f"entries of {n} the second moment {key} is 0 (a (1-β2)·g² that underflowed {dt}): the update "
                    "divided by sqrt(0) + 0. Use an eps the dtype represents, or — sturdier — float32 master weights "
                    "with autocast instead of .half().",
                    Fix(FixKind.OPTIMIZER_EPS,
                        f"model = model.float()  # float32 master weights; run the forward under\n"
                        f"# torch.autocast(..., dtype=torch.{dt}) with a torch.amp.GradScaler\n"
                        f"# or keep .half() with an eps {dt} represents: torch.optim.{cls}(..., eps={e * 10:g})",
                        epsilon=e * 10))
    return None


def _overflow(facts, hyper: dict, cls: str):
    for n, w, bad, _ in facts:
        if not w.is_floating_point():
            continue
        fmax = torch.finfo(w.dtype).max
        ok = w[~bad]
        top = float(ok.abs().max()) if ok.numel() else 0.0
        infs = int(torch.isinf(w).sum())
        if infs and infs * 2 >= int(bad.sum()) and top >= 0.01 * fmax:
            lr = (hyper.get(n) or {}).get("lr")
            dt = stats.dtype_name(w.dtype)
            return ("update_overflow", f"the update overflowed {dt}",
                    f"{infs} entries of {n} are ±Inf and its finite entries reach {g(top)}, "
                    f"{100 * top / fmax:.2g}% of {dt}'s largest value {g(fmax)}: the update (lr = "
                    f"{g(lr) if isinstance(lr, (int, float)) else '?'}) took weights beyond the dtype's range. "
                    "Lower the learning rate (or warm it up), clip the gradients, or keep float32 master weights.",
                    Fix(FixKind.LOWER_LR_CLIP_GRADS,
                        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # and a lower learning rate"))
    return None
