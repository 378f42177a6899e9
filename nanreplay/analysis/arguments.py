"""Which argument of an op each recorded tensor input was: its schema name and, where known, its role.

A culprit's inputs are recorded as a list of tensor statistics in call order. People read
"input 2" badly; "mat2 — the weight (transposed)" or "self — the incoming gradient" tells
the story. Names come from the op's own schema; roles from a small table of the ops and
backward formulas that culprits are made of. Where the mapping is ambiguous (optional or
list arguments whose presence the statistics do not show) the name is left out rather
than guessed.
"""

from __future__ import annotations

from typing import Any

import torch

from nanreplay import torch_internals as ti

# forward op (aten packet name) -> schema argument -> role
_FORWARD: dict[str, dict[str, str]] = {
    "div": {"self": "numerator", "other": "denominator"},
    "mul": {"self": "left factor", "other": "right factor"},
    "pow": {"self": "base", "exponent": "exponent"},
    "xlogy": {"self": "x (the factor)", "other": "y (inside the log)"},
    "where": {"condition": "condition", "self": "value where true", "other": "value where false"},
    "convolution": {"input": "activations (the layer's input)", "weight": "weight", "bias": "bias"},
    "native_layer_norm": {"input": "activations (the layer's input)", "weight": "weight (scale)", "bias": "bias"},
    "native_batch_norm": {"input": "activations (the layer's input)", "weight": "weight (scale)", "bias": "bias",
                          "running_mean": "running mean", "running_var": "running variance"},
    "_softmax": {"self": "logits"},
    "_log_softmax": {"self": "logits"},
    "mse_loss": {"self": "prediction", "target": "target"},
    "l1_loss": {"self": "prediction", "target": "target"},
    "nll_loss_forward": {"self": "log-probabilities", "target": "target", "weight": "class weights"},
    "binary_cross_entropy": {"self": "predicted probabilities", "target": "target", "weight": "weights"},
    "binary_cross_entropy_with_logits": {"self": "logits", "target": "target", "weight": "weights"},
}
# how nn.Linear / F.linear runs: its aten ops take the layer's tensors in these slots
_LINEAR: dict[str, dict[str, str]] = {
    "addmm": {"self": "bias", "mat1": "activations (the layer's input)", "mat2": "weight (transposed)"},
    "mm": {"self": "activations (the layer's input)", "mat2": "weight (transposed)"},
    "bmm": {"self": "activations (the layer's input)", "mat2": "weight (transposed)"},
    "matmul": {"self": "activations (the layer's input)", "other": "weight (transposed)"},
}
_UNARY = frozenset({"sqrt", "rsqrt", "log", "log2", "log10", "log1p", "exp", "exp2", "expm1", "reciprocal", "acos",
                    "asin", "atanh", "sigmoid", "tanh", "lgamma", "digamma", "erfinv", "sinh", "cosh", "neg", "abs"})
# (autograd node, aten op inside its backward formula) -> schema argument -> role
_BACKWARD: dict[tuple[str, str], dict[str, str]] = {
    ("SqrtBackward0", "div"): {"self": "incoming gradient", "other": "2·sqrt(x): twice sqrt's output"},
    ("LogBackward0", "div"): {"self": "incoming gradient", "other": "x: log's input"},
    ("Log2Backward0", "div"): {"self": "incoming gradient", "other": "x·ln 2: log2's input, scaled"},
    ("Log10Backward0", "div"): {"self": "incoming gradient", "other": "x·ln 10: log10's input, scaled"},
    ("ReciprocalBackward0", "mul"): {"self": "incoming gradient"},
    ("PowBackward0", "pow"): {"self": "x: pow's input"},
    ("NormBackward1", "div"): {"self": "incoming gradient", "other": "the norm (the op's output)"},
    ("LinalgVectorNormBackward0", "div"): {"self": "incoming gradient", "other": "the norm (the op's output)"},
}
_BACKWARD_BY_OP: dict[str, dict[str, str]] = {
    "_softmax_backward_data": {"grad_output": "incoming gradient", "output": "softmax's output (saved)"},
    "_log_softmax_backward_data": {"grad_output": "incoming gradient", "output": "log_softmax's output (saved)"},
}


def _packet(op: str | None) -> str:
    """'aten.div.Tensor' -> 'div' (the trailing underscore of in-place ops dropped)."""
    parts = (op or "").split(".")
    base = parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]
    return base.rstrip("_") or base


def _overload(op: str | None) -> Any | None:
    parts = (op or "").split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    try:
        return getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None


def tensor_arg_names(op: str | None, n: int) -> list[str | None]:
    """The schema name of each of `n` recorded tensor inputs (call order), or None where it is ambiguous."""
    schema = ti.op_schema(_overload(op)) if _overload(op) is not None else None
    if schema is None:
        return [None] * n
    required, optional, lists = [], [], []
    slots: list[tuple[str, str]] = []  # (name, "one" | "opt" | "list") in schema order
    for a in schema.arguments:
        t = str(a.type)
        if t == "Tensor":
            kind = "one"
            required.append(a.name)
        elif t == "Optional[Tensor]":
            kind = "opt"
            optional.append(a.name)
        elif t in ("List[Tensor]", "List[Optional[Tensor]]"):
            kind = "list"
            lists.append(a.name)
        else:
            continue
        slots.append((a.name, kind))
    names: list[str] = []
    if not lists and n == len(required):
        names = [s for s, k in slots if k == "one"]
    elif not lists and n == len(required) + len(optional):
        names = [s for s, _ in slots]
    elif len(lists) == 1 and not optional and n >= len(required):
        for s, k in slots:
            names += [f"{s}[{j}]" for j in range(n - len(required))] if k == "list" else [s]
    return names if len(names) == n else [None] * n


def input_roles(op: str | None, names: list[str | None], *, backward_node: str | None = None,
                call: str | None = None) -> list[str | None]:
    """What each named input is in the user's terms: 'bias', 'incoming gradient', 'numerator' ..."""
    base = _packet(op)
    if backward_node:
        table = _BACKWARD.get((backward_node, base)) or _BACKWARD_BY_OP.get(base) or {}
        generic = {"grad_output": "incoming gradient", "grad": "incoming gradient"}
        return [table.get(n or "") or generic.get(n or "") for n in names]
    if call and call.rsplit(".", 1)[-1] == "linear" and base in _LINEAR:
        table = _LINEAR[base]
    elif base in _UNARY:
        table = {"self": f"x: {base}'s input"}
    else:
        table = _FORWARD.get(base, {})
    return [table.get(n or "") for n in names]


def name_inputs(op: str | None, inputs: list[dict], *, backward_node: str | None = None,
                call: str | None = None) -> list[dict]:
    """`inputs` (tensor statistics, call order) with `arg` (schema name) and `role` added to each."""
    names = tensor_arg_names(op, len(inputs))
    roles = input_roles(op, names, backward_node=backward_node, call=call)
    return [{**s, "arg": a, "role": r} for s, a, r in zip(inputs, names, roles, strict=True)]
