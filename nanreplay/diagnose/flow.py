"""Where a gradient stops: the analysis of a `no_gradient` / `gradient_died` snapshot (docs/flow.md).

The step program is run once more with every value kept. For each parameter the guard named, the data flow of
the recorded ops says which values depend on it and reach the loss (its *path*); autograd says which of them
carry a gradient. Two verdicts:

* `gradient_cut`: on the path a value that needs a gradient feeds an op whose output has none (`detach`, an op
  run under `no_grad`, an integer result such as `argmax` or a cast), or the parameter's value reaches the
  loss only as a copy taken outside autograd (`.data`, a tensor rebuilt from `.item()`). The first cut from the
  parameter is the culprit; the others are listed.
* `gradient_zero`: every path carries a graph, but one backward node turns a non-zero incoming gradient into
  exact zeros (a dead ReLU, a saturated sigmoid or tanh, round/floor/sign, a clamp out of range, `where`
  choosing a constant, a zero multiplier). The node nearest the loss is named, with its forward op, line and the
  fraction of its elements (and of its units, the last dimension) whose local derivative is zero. A zero
  multiplier that is itself the output of such a node (the activations a dead ReLU passes on) names that node.

Fixes come from `FIXES`; removing a cut (a detach, a no_grad region, a `.data` copy) is verified by replay: the
loss is the same bit for bit and the parameter's gradient is no longer zero.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanreplay.capture.flow import SHAPE_ONLY
from nanreplay.formats.program import node_inputs, node_outputs

LEAKY_MAX_CHANGE = 0.5  # LeakyReLU repairs dead units when the loss it gives differs by at most this (relative)
CUT_OPS = {"aten.detach.default": "detach", "aten.detach_.default": "detach"}
STE = ("a straight-through estimator keeps the forward value and lets the gradient through: "
       "`y = soft + (hard - soft).detach()` (or torch.nn.functional.gumbel_softmax(..., hard=True))")
FIXES = {  # kind -> (fix kind, advice)
    "detach": ("remove_cut", "remove the .detach() on this line: it keeps the gradient from reaching the parameters "
                             "before it"),
    "data_copy": ("remove_cut", "use the tensor itself, not `.data` (or a tensor rebuilt from `.item()` / "
                                "`.tolist()`): the copy carries no gradient"),
    "no_grad": ("remove_cut", "run this computation with gradients on (outside `torch.no_grad()` / "
                              "`torch.inference_mode()`, or inside `torch.enable_grad()`)"),
    "reentrant_checkpoint": ("use_reentrant_false", "a reentrant checkpoint runs its region under no_grad and "
                                                     "gives its parameters a gradient only when an input needs one; "
                                                     "none does here: pass use_reentrant=False (transformers: "
                                                     "gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                                                     "{'use_reentrant': False}), or enable_input_require_grads())"),
    "integer": ("straight_through", "an integer result (argmax, a cast to an integer dtype) has no gradient: " + STE),
    "argmax": ("straight_through", "argmax has no gradient, so whatever computed its input (a router, a scorer) "
                                   "never learns: weight what the choice selects by its softmax probability "
                                   "(`probs = logits.softmax(-1); y = y * probs.gather(-1, choice[:, None])`, as "
                                   "mixture-of-experts routers do), or " + STE),
    "frozen": ("unfreeze", "the parameter has requires_grad=False although it is tied to a trained module's "
                           "weight: call .requires_grad_(True) on it (or untie the weights if the freeze was meant)"),
    "relu": ("leaky_relu", "the ReLU units are dead (negative input for every sample): use LeakyReLU/GELU, "
                           "re-initialise the layer, and lower (or warm up) the learning rate that pushed them there"),
    "saturated": ("logits", "the activation is saturated (its derivative is exactly zero): where a loss reads its "
                            "probabilities, compute the loss from logits (binary_cross_entropy_with_logits, "
                            "log_softmax) rather than from saturated probabilities; inside the model (a gate, an "
                            "RNN's state), keep its input small: a smaller init (an RNN's recurrent weight and "
                            "bias), normalisation before it, a lower learning rate"),
    "softmax_single": ("softmax_dim", "this softmax runs over a dimension of size 1: its output is 1 whatever the "
                                      "input, so nothing before it learns; take the softmax over the dimension meant "
                                      "(the tokens, say dim=1)"),
    "discrete": ("straight_through", "round/floor/sign have a zero derivative everywhere: " + STE),
    "clamp": ("straight_through", "every value is clamped: the gradient is zero outside the range; clamp only the "
                                  "forward value (`x + (x.clamp(lo, hi) - x).detach()`) or widen the range"),
    "where": ("double_where", "`where` picks the branch that does not depend on the parameter for every element; "
                              "check the mask"),
    "zero_multiplier": ("check_multiplier", "the value is multiplied by exact zeros: check what makes the other "
                                            "factor zero (a zero-initialised gate stays zero only while it gets no "
                                            "gradient itself)"),
    "other": ("none", "this op's derivative is exactly zero for every element here"),
}
_ACTIVATION = {"relu": "relu", "threshold": "relu", "hardtanh": "clamp", "clamp": "clamp", "clip": "clamp",
               "sigmoid": "saturated", "tanh": "saturated", "softmax": "saturated", "_softmax": "saturated",
               "round": "discrete", "floor": "discrete", "ceil": "discrete", "sign": "discrete", "trunc": "discrete",
               "where": "where", "mul": "zero_multiplier", "mm": "zero_multiplier", "addmm": "zero_multiplier",
               "bmm": "zero_multiplier", "matmul": "zero_multiplier", "linear": "zero_multiplier"}


def _kind_of(op_name: str) -> str:
    base = op_name.split(".")[1] if op_name.count(".") >= 2 else op_name
    return _ACTIVATION.get(base.rstrip("_"), "other")


class Run:
    """The program run once with every value kept (and, optionally, some cuts undone)."""

    def __init__(self, model, inputs: Any, target: Any, *, undo: set[int] = frozenset(), link: dict | None = None,
                 leaky: set[int] = frozenset()):
        self.model, prog = model, model.program
        self.env = model._leaves(inputs, target)
        for ref, name in (link or {}).items():  # a `.data` copy replaced by the parameter itself
            self.env[ref] = model._by_name[name]
        with torch.enable_grad():
            for i, node in enumerate(prog.nodes):
                model._node = i
                torch.set_grad_enabled(node.grad or i in undo)
                if i in undo and node.name in CUT_OPS:
                    args, _ = model._checked_args(node, self.env)
                    out = torch.ops.aten.alias.default(args[0])
                elif i in leaky:  # a ReLU replayed as LeakyReLU(0.01)
                    args, _ = model._checked_args(node, self.env)
                    op = torch.ops.aten.leaky_relu_ if node.name.endswith("relu_.default") else torch.ops.aten.leaky_relu
                    out = op.default(args[0], 0.01)
                else:
                    out = model._run(node, self.env)
                model._bind(node, out, self.env, i)
        model._node = None
        self.loss = self.env[prog.loss]


def _source(prog, node) -> dict | None:
    if node.frame is None:
        return None
    f = prog.frames[node.frame]
    return {"file": f["file"], "line": f["line"], "code": f["code"]}


def _where(prog, i: int) -> dict:
    node = prog.nodes[i]
    return {"node": i, "op": node.name, "forward_op": node.name, "module": prog.modules[node.module],
            "source": _source(prog, node), "call": prog.calls[node.call] if node.call else None}


def _paths(prog, constants: dict, params: dict) -> tuple[set[int], dict[str, set[int]], dict[int, str]]:
    """(refs the loss depends on, per parameter the refs that depend on it, constant ref -> parameter it copies)."""
    need = {prog.loss}
    for node in reversed(prog.nodes):
        if _shape_only(node):
            continue
        if any(r in need for r in node_outputs(node)):
            need.update(node_inputs(node))
    refs = {lf.name: lf.ref for lf in prog.leaves if lf.kind == "param"}
    copies: dict[int, str] = {}
    for lf in prog.leaves:
        if lf.kind == "constant" and lf.ref in need:
            c = constants.get(lf.name)
            for name, p in params.items():
                if _same(c, p):
                    copies[lf.ref] = name
    deps: dict[str, set[int]] = {}
    for name in params:
        seeds = {r for r in [refs.get(name)] if r is not None} | {r for r, n in copies.items() if n == name}
        dep = set(seeds)
        for node in prog.nodes:
            if not _shape_only(node) and any(r in dep for r in node_inputs(node)):
                dep.update(node_outputs(node))
        deps[name] = dep
    return need, deps, copies


def _shape_only(node) -> bool:
    """An op that reads only its input's shape (zeros_like, empty_like, new_zeros): no value flows through it."""
    base = node.name.split(".")[1] if node.name.count(".") >= 2 else node.name
    return base in SHAPE_ONLY


def _same(c, p) -> bool:
    return (isinstance(c, torch.Tensor) and c.shape == p.shape and c.dtype == p.dtype and p.numel() > 1
            and bool(p.amin() != p.amax()) and bool(torch.equal(c, p.detach())))


def _grad_of(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _cuts(prog, env: dict, path: set[int], copies: dict[int, str], name: str) -> list[dict]:
    out = []
    for ref, pname in copies.items():
        if pname == name and ref in path:
            first = next((i for i, n in enumerate(prog.nodes) if ref in node_inputs(n)), None)
            row = _where(prog, first) if first is not None else {"node": None, "op": None, "source": None}
            out.append({**row, "kind": "data_copy", "ref": ref})
    for i, node in enumerate(prog.nodes):
        ins = [r for r in node_inputs(node) if r in path and _grad_of(env.get(r))]
        outs = [r for r in node_outputs(node) if r in path]
        if not ins or not outs or any(_grad_of(env.get(r)) for r in outs):
            continue
        t = env.get(outs[0])
        kind = ("no_grad" if not node.grad else CUT_OPS.get(node.name)
                or ("integer" if isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex())
                    else "no_grad"))
        row = _where(prog, i)
        if kind == "no_grad" and "checkpoint" in str((row.get("source") or {}).get("code") or "").lower():
            kind = "reentrant_checkpoint"  # its forward runs under no_grad; with no input needing grad, no backward
        code = str((row.get("source") or {}).get("code") or "")
        if kind == "detach" and ".data" in code and "detach" not in code:  # `p.data` runs as a detach: say `.data`
            row["detach_node"] = True  # (undone by the replay like a detach)
            kind = "data_copy"
        out.append({**row, "kind": kind})
    out.sort(key=lambda c: (c["node"] is None, c["node"] or 0))
    return out


def _nonzero(t) -> bool:
    g = t.grad if isinstance(t, torch.Tensor) else None
    return g is not None and bool((g != 0).any())


def _zero_node(prog, env: dict, path: set[int]) -> tuple[int, int] | None:
    """(node, input ref): the node nearest the loss whose output's gradient is non-zero and whose input on the
    parameter's path gets an all-zero gradient, and none a non-zero one: a node that passes the gradient on through
    one input goes on there (`stack` of an RNN's states, read at the last step only, gives the others zeros)."""
    for i in range(len(prog.nodes) - 1, -1, -1):
        node = prog.nodes[i]
        if not any(r in path and _nonzero(env.get(r)) for r in node_outputs(node)):
            continue
        ins = [r for r in node_inputs(node) if r in path and _grad_of(env.get(r))]
        if any(_nonzero(env.get(r)) for r in ins):
            continue
        if ins:
            return i, ins[0]
    return None


def _local_zero(model, env: dict, i: int, ref: int) -> dict:
    """The fraction of the input's elements (and of its last-dimension units) whose local derivative is 0."""
    node = model.program.nodes[i]
    x = env[ref].detach().requires_grad_(True)
    with torch.enable_grad():
        args, kwargs = model._checked_args(node, env)
        target = env[ref]
        args = [x if a is target else a for a in args]
        kwargs = {k: (x if v is target else v) for k, v in kwargs.items()}
        out = node.op(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        (d,) = torch.autograd.grad(out, x, torch.ones_like(out), allow_unused=True)
    if d is None:
        return {"elements": 1.0, "units": 1.0}
    z = d == 0
    units = z.reshape(-1, z.shape[-1]).all(dim=0).float().mean() if z.dim() >= 1 and z.numel() else z.float()
    return {"elements": float(z.float().mean()), "units": float(units)}


def _zero_cause(model, env: dict, i: int, ref: int) -> dict:
    prog = model.program
    node = prog.nodes[i]
    kind = _kind_of(node.name)
    if kind == "zero_multiplier":  # the other factor is zero: who made it so?
        for r in node_inputs(node):
            t = env.get(r)
            if r != ref and isinstance(t, torch.Tensor) and t.is_floating_point() and not bool((t != 0).any()):
                j = next((k for k in range(i - 1, -1, -1) if r in node_outputs(prog.nodes[k])), None)
                while j is not None and _kind_of(prog.nodes[j].name) == "other" and node_inputs(prog.nodes[j]):
                    src = node_inputs(prog.nodes[j])[0]  # a view or copy of it: go to what made it
                    j = next((k for k in range(j - 1, -1, -1) if src in node_outputs(prog.nodes[k])), None)
                if j is not None and _kind_of(prog.nodes[j].name) not in ("other", "zero_multiplier"):
                    src = node_inputs(prog.nodes[j])[0]
                    return {**_where(prog, j), "kind": _kind_of(prog.nodes[j].name),
                            "local_zero": _local_zero(model, env, j, src), "via": _where(prog, i)}
    if kind == "saturated" and "softmax" in node.name and len(node.args) > 1 and isinstance(node.args[1], int):
        x = env.get(ref)
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[node.args[1]] == 1:
            kind = "softmax_single"  # softmax over one element is 1 whatever the input
    return {**_where(prog, i), "kind": kind, "local_zero": _local_zero(model, env, i, ref)}


def analyze(subject, info: dict, *, verify: bool = True) -> dict | None:
    """The `gradient_flow` object for the parameters the guard named (None without a step program); the fixes
    replayed unless `verify` is off (`--no-verify`)."""
    model = subject.model
    prog = getattr(model, "program", None)
    if prog is None or not getattr(subject, "program", False):
        return None
    flow = info.get("gradient_flow") or {}
    dead = [d for d in flow.get("dead") or [] if isinstance(d, dict)]
    params = {n: p for n, p in model.named_parameters()}
    params.update({a: params[t] for a, t in model.aliases.items() if t in params})
    names = [d["name"] for d in dead if d.get("name") in params]
    run = Run(model, subject.inputs, subject.target)
    need, deps, copies = _paths(prog, model.constants, {n: params[n] for n in names})
    keep = [r for n in names for r in deps[n] & need if _grad_of(run.env.get(r)) and r != prog.loss]
    for r in set(keep):
        if not run.env[r].is_leaf:
            run.env[r].retain_grad()
    model.zero_grad(set_to_none=True)
    if run.loss.requires_grad:
        run.loss.backward()
    rows = []
    for d in dead:
        name = d.get("name")
        row: dict[str, Any] = {"name": name, "gradient": d.get("gradient"), "had_gradient": d.get("had_gradient")}
        if d.get("gradient") == "frozen":
            row.update(verdict="gradient_cut", kind="frozen", op=None, source=None,
                       why="requires_grad=False on a parameter tied to a trained module's weight")
            use = _use_of(prog, model, name or "")
            if use is not None:  # where its frozen value enters the step under this name (a tied decoder's matmul)
                row.update(**{k: v for k, v in _where(prog, use).items() if k != "forward_op"})
            rows.append(row)
            continue
        if name not in params:
            row.update(verdict="unknown", why="the step program does not name this parameter")
            rows.append(row)
            continue
        path = deps[name] & need
        p = params[name]
        g = p.grad
        cuts = _cuts(prog, run.env, path, copies, name)
        if not path:
            row.update(verdict="unused", why="its value does not reach the loss in this step")
        elif cuts and g is None:  # (a zero gradient has a path: why it is zero is the question)
            row.update(verdict="gradient_cut", **{k: v for k, v in cuts[0].items() if k != "ref"},
                       others=[{k: v for k, v in c.items() if k != "ref"} for c in cuts[1:5]])
        elif g is None or not bool((g != 0).any()):
            z = _zero_node(prog, run.env, path)
            if z is None:
                row.update(verdict="gradient_zero", kind="other", node=None, op=None, source=None,
                           why="no single backward node turns its gradient to zero (the loss's gradient itself?)")
            else:
                row.update(verdict="gradient_zero", **_zero_cause(model, run.env, *z))
        else:
            row.update(verdict="flows", why="the replay gives it a non-zero gradient")
        rows.append(row)
    run = None
    model.zero_grad(set_to_none=True)
    regions = []
    for c in [c for r in rows for c in [r, *r.get("others", [])]]:
        if c.get("kind") == "no_grad" and flow.get("reentrant_checkpoint"):  # the guard saw it: no_grad ops run
            c["kind"] = "reentrant_checkpoint"  # inside a reentrant checkpoint's forward
        if c.get("kind") == "reentrant_checkpoint" and c.get("node") is not None:
            regions.append((_at_checkpoint(prog, c), c))
    call, caller = flow.get("checkpoint_call"), flow.get("checkpoint_caller")
    for start, c in regions:  # the guard saw the first region's call: the rows cut in that region are said there
        if start == min(s for s, _ in regions) and isinstance(call, dict) and call.get("file"):
            c["checkpoint"].update(call=call, caller=caller)
            c["source"] = {"file": call["file"], "line": call["line"], "code": call.get("code")}
    verified: dict[tuple, dict] = {}  # one replay per place: the rows that stop at the same node share it
    for row in rows if verify else []:
        key = (row.get("verdict"), row.get("kind"), row.get("node"), row["name"] if row.get("kind") == "frozen" else 0)
        same = [r for r in rows if (r.get("verdict"), r.get("kind"), r.get("node")) == key[:3]]
        if key in verified:
            row["fix"] = verified[key]
        elif row.get("verdict") == "gradient_cut" and row.get("kind") in ("detach", "no_grad", "data_copy",
                                                                          "reentrant_checkpoint"):
            row["fix"] = verified[key] = _verify_cut(subject, prog, same, copies, params)
        elif row.get("verdict") == "gradient_zero" and row.get("kind") == "relu" and row.get("node") is not None:
            row["fix"] = verified[key] = _verify_leaky(subject, prog, same, deps, need, params)
        elif row.get("kind") == "frozen" and row["name"] in params:
            row["fix"] = verified[key] = _verify_unfreeze(subject, row, params)
    verdicts = [r["verdict"] for r in rows]
    verdict = ("gradient_cut" if "gradient_cut" in verdicts else "gradient_zero" if "gradient_zero" in verdicts
               else None)
    return {"verdict": verdict, "parameters": [r["name"] for r in rows if r["verdict"] in ("gradient_cut",
                                                                                             "gradient_zero")],
            "per_parameter": rows, "frozen": list(flow.get("frozen") or []), "all_zero": bool(flow.get("all_zero"))}


def _use_of(prog, model, name: str) -> int | None:
    """The first op that reads this parameter inside the module that owns it under this name (else anywhere)."""
    canon = model.aliases.get(name, name)
    refs = {lf.ref for lf in prog.leaves if lf.kind == "param" and model.aliases.get(lf.name, lf.name) == canon}
    owner = name.rpartition(".")[0]
    readers = [i for i, n in enumerate(prog.nodes) if any(r in refs for r in node_inputs(n))]
    return next((i for i in readers if prog.modules[prog.nodes[i].module] == owner), readers[0] if readers else None)


def _at_checkpoint(prog, row: dict) -> int:
    """A cut inside a reentrant checkpoint is the checkpoint's: the row's module becomes the checkpointed one (the
    outermost module call around the op whose every op ran under no_grad); the op's own line is kept as
    `checkpoint.inside`. Returns the index of the region's first node (the guard saw the first region's call)."""
    node = prog.nodes[row["node"]]
    chain, s = [], node.scope
    while s is not None and s >= 0:
        chain.append(s)
        s = prog.scopes[s][1]
    inside: dict[int, bool] = {}  # scope -> every op in it ran under no_grad
    first: dict[int, int] = {}  # scope -> its first node
    for i, n in enumerate(prog.nodes):
        s = n.scope
        while s is not None and s >= 0:
            inside[s] = inside.get(s, True) and not n.grad
            first.setdefault(s, i)
            s = prog.scopes[s][1]
    scope = next((s for s in reversed(chain) if inside.get(s)), None)
    region = prog.modules[prog.scopes[scope][0]] if scope is not None else None
    row["checkpoint"] = {"module": region, "call": None, "caller": None, "first_op": node.name,
                         "inside": row.get("source"), "inside_module": row.get("module")}
    if region is not None:
        row["module"] = region
    return first.get(scope, row["node"]) if scope is not None else row["node"]


def _replayed(subject, params: dict, names: list[str], before: torch.Tensor, **undo) -> dict:
    """Replay with a change (Run's keywords) and say whether every named parameter now gets a finite, non-zero
    gradient, and how the loss moved."""
    model = subject.model
    run = Run(model, subject.inputs, subject.target, **undo)
    model.zero_grad(set_to_none=True)
    if run.loss.requires_grad:
        run.loss.backward()
    grads = [params[n].grad for n in names]
    flows = all(g is not None and bool((g != 0).any()) and bool(torch.isfinite(g).all()) for g in grads)
    norm = math.sqrt(sum(float(g.double().norm()) ** 2 for g in grads if g is not None))
    loss = run.loss.detach()
    same = bool(torch.equal(loss, before))
    rel = float((loss.double() - before.double()).abs() / before.double().abs().clamp_min(1e-30))
    model.zero_grad(set_to_none=True)
    return {"flows": flows, "replay": {"loss_unchanged": same, "loss_change": rel if math.isfinite(rel) else None,
                                       "grad_norm": norm if math.isfinite(norm) else None}}


def _verify_leaky(subject, prog, same: list[dict], deps: dict, need: set, params: dict) -> dict:
    """Replay with the ReLUs on the dead parameters' paths as LeakyReLU(0.01): verified when every parameter this
    ReLU starved gets a non-zero gradient again (the loss moves a little: the dead units now pass 1% of their
    input; `loss_change` says how much)."""
    fix_kind, advice = FIXES["relu"]
    out = {"kind": fix_kind, "advice": advice, "verified": None}
    names = [r["name"] for r in same]
    try:
        before = Run(subject.model, subject.inputs, subject.target).loss.detach()
        path = set().union(*(deps[n] & need for n in names))
        leaky = {i for i, n in enumerate(prog.nodes) if _kind_of(n.name) == "relu" and n.name.split(".")[1]
                 in ("relu", "relu_") and any(r in path for r in node_inputs(n))}
        got = _replayed(subject, params, names, before, leaky=leaky)
        moved = got["replay"]["loss_change"]
        small = moved is not None and moved <= LEAKY_MAX_CHANGE
        out.update(verified=got["flows"] and small and bool(torch.isfinite(before)), replay=got["replay"],
                   swapped=len(leaky))
        if got["flows"] and not small:  # the units' inputs are far below zero: 1% of them is no small change
            out["why"] = ("the gradient flows again, but the loss changes by "
                          + (f"{moved:.3g}x" if moved is not None else "a non-finite amount")
                          + ": the units' inputs are far below zero (weights an update blew up), so LeakyReLU "
                          "alone does not repair them; re-initialise the layer and lower the learning rate")
    except Exception as e:  # noqa: BLE001 - verification is an extra
        out["why"] = f"the replay with LeakyReLU raised {type(e).__name__}: {e}"
    return out


def _verify_unfreeze(subject, row: dict, params: dict) -> dict:
    """Replay with the tied weight's requires_grad on: the same loss bit for bit and a non-zero gradient."""
    fix_kind, advice = FIXES["frozen"]
    out = {"kind": fix_kind, "advice": advice, "verified": None}
    p = params[row["name"]]
    was = p.requires_grad
    try:
        before = Run(subject.model, subject.inputs, subject.target).loss.detach()
        p.requires_grad_(True)
        got = _replayed(subject, params, [row["name"]], before)
        out.update(verified=got["flows"] and got["replay"]["loss_unchanged"], replay=got["replay"])
    except Exception as e:  # noqa: BLE001 - verification is an extra
        out["why"] = f"the replay with requires_grad on raised {type(e).__name__}: {e}"
    finally:
        p.requires_grad_(was)
        p.grad = None
    return out


def _verify_cut(subject, prog, same: list[dict], copies: dict[int, str], params: dict) -> dict:
    """Replay with these rows' cut undone (rows cut at the same place): the same loss bit for bit, and a non-zero
    gradient for each of their parameters."""
    fix_kind, advice = FIXES[same[0]["kind"]]
    out = {"kind": fix_kind, "advice": advice, "verified": None}
    names = [r["name"] for r in same]
    try:
        before = Run(subject.model, subject.inputs, subject.target).loss.detach()
        undo = {c["node"] for r in same for c in [r, *r.get("others", [])] if c.get("node") is not None
                and (c.get("kind") == "detach" or c.get("detach_node"))} | {i for i, n in enumerate(prog.nodes) if not n.grad}
        link = {r: n for r, n in copies.items() if n in names}
        got = _replayed(subject, params, names, before, undo=undo, link=link)
        out.update(verified=got["replay"]["loss_unchanged"] and got["flows"], replay=got["replay"])
    except Exception as e:  # noqa: BLE001 - verification is an extra
        out["why"] = f"the replay with the cut removed raised {type(e).__name__}: {e}"
    return out
