"""The `update` field of a native snapshot (trigger "update"): what a replay of `optimizer.step()` needs.

    class, qualname          the optimizer's class name ("Adam"); rebuilt only from torch.optim's own
                             classes by that name (replay/update.py), never imported from `qualname`
    implementation           "single_tensor" | "foreach" | "fused"
    groups                   [{"params": [parameter names], "hyper": {lr, betas, eps, ...}}] (plain values)
    state                    {parameter name: {key: tensor or number}}: the optimizer state before the step
    gradients                {parameter name: tensor}: the gradients the step used
    pre_step                 how the snapshot's weights (its `state` field) were obtained: "copied" (exact),
                             "reconstructed" (recovered from the state after the step), "post_step" (the
                             weights after the step: not replayable)
    lost, stand_in           reconstructed entries that could not be recovered (bool masks) and what they hold
    extra_weights            optimizer parameters the model does not own, by name
    nonfinite_after          {parameter name: {numel, nan, posinf, neginf}} as the step left them
    grad_scale, scheduler, notes

`check()` is the schema checker native.py's field table uses; `cross_check()` then ties every name
and shape to the snapshot's parameters.
"""

from __future__ import annotations

import torch

from nanreplay.formats import schema as S

# torch.optim classes the analysis rebuilds by name (getattr(torch.optim, name) for these names only)
REPLAYABLE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop")
IMPLEMENTATIONS = ("single_tensor", "foreach", "fused")
PRE_STEP = ("copied", "reconstructed", "post_step")
_NAME = S.string(1000)


def _state_value(v, where):
    if isinstance(v, torch.Tensor):
        return S.tensor()(v, where)
    return S.number(v, where)


_COUNTS = S.record({"numel": S.integer(0), "nan": S.integer(0), "posinf": S.integer(0), "neginf": S.integer(0)},
                   required=("numel", "nan", "posinf", "neginf"))
_GROUP = S.record({"params": S.list_of(_NAME), "hyper": S.dict_of(S.plain_value, limit=64)}, required=("params", "hyper"))
_SCHEDULER = S.record({"class": S.string(200), "last_epoch": S.optional(S.integer()),
                       "last_lr": S.optional(S.list_of(S.number, 100_000)),
                       "base_lrs": S.optional(S.list_of(S.number, 100_000))}, required=("class",))

check = S.record({
    "class": S.string(100), "qualname": S.optional(S.string(500)),
    "implementation": S.one_of(*IMPLEMENTATIONS),
    "groups": S.list_of(_GROUP, 100_000),
    "state": S.dict_of(S.dict_of(_state_value, limit=32)),
    "gradients": S.dict_of(S.tensor()),
    "pre_step": S.one_of(*PRE_STEP),
    "lost": S.optional(S.dict_of(S.tensor((torch.bool,)))),
    "stand_in": S.optional(S.string(2000)),
    "extra_weights": S.optional(S.dict_of(S.tensor())),
    "nonfinite_after": S.optional(S.dict_of(_COUNTS)),
    "grad_scale": S.optional(S.number),
    "scheduler": S.optional(_SCHEDULER),
    "notes": S.optional(S.list_of(S.string(2000), 50)),
}, required=("class", "implementation", "groups", "state", "gradients", "pre_step"))

# The optimizer record every native snapshot may hold (its state dict is checked where it is read: diagnose/late.py)
optimizer_param_names = S.list_of(S.string(1000))


def cross_check(update: dict, state: dict[str, torch.Tensor]) -> str | None:
    """What is wrong with an update record next to the snapshot's weights (None: nothing)."""
    weights = {**state, **(update.get("extra_weights") or {})}
    names = [n for g in update["groups"] for n in g["params"]]
    if len(set(names)) != len(names):
        return "update.groups names a parameter twice"
    for n in names:
        if n not in weights:
            return f"update.groups names {n!r}, which the snapshot does not hold"
    for field in ("gradients", "lost", "state"):
        if field == "state" and update["class"] not in REPLAYABLE:
            continue  # other optimizers keep state of other shapes (factored second moments): not replayed
        for n, v in (update.get(field) or {}).items():
            if n not in weights or n not in names:
                return f"update.{field} names {n!r}, which is not an optimizer parameter"
            w = weights[n]
            tensors = [v] if isinstance(v, torch.Tensor) else [t for t in v.values() if isinstance(t, torch.Tensor)
                                                              and t.dim() > 0]
            for t in tensors:
                if t.shape != w.shape:
                    return f"update.{field}[{n!r}] has shape {list(t.shape)}, the parameter {list(w.shape)}"
    return None

