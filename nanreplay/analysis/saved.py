"""A backward culprit's forward inputs, read off the culprit itself where its backward formula takes them unchanged.

`LogBackward0` computes `grad / x` with `x` the very tensor `log` read (autograd saved it; a real tensor's
`conj()` is itself), and `PowBackward0` computes `x.pow(e - 1)` on the saved `x`. For these the culprit event
already holds the statistics of the forward op's only tensor input, made by the same `stats.tensor_stats` on the
same values (a saved tensor written in place afterwards makes backward raise, so it is the value forward read):
the second look that would otherwise replay the forward up to that op (`replay/probe.py`; for a plain-dict
`--model` step, whose forward is not a program with kept boundaries, the whole forward when the log is the
model's last line) is not needed. Anything else, or anything that does not line up: None, and the caller looks
the usual way.
"""

from __future__ import annotations

from nanreplay.analysis.arguments import tensor_arg_names

# (autograd node, aten op inside its backward formula, forward aten op) -> the backward op's argument that is the
# forward op's one tensor input, as forward read it. Only out-of-place forward ops with one tensor input: an
# in-place op's node saves another tensor, and an op with two tensor inputs has one the culprit does not show.
SAVED_INPUT: dict[tuple[str, str, str], str] = {
    ("LogBackward0", "aten.div.Tensor", "aten.log.default"): "other",
    ("PowBackward0", "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Scalar"): "self",
}


def forward_inputs(ev, forward_op: str) -> list[dict] | None:
    """The statistics of the forward op's tensor inputs (call order) from the backward culprit `ev`, or None."""
    arg = SAVED_INPUT.get((ev.node or "", str(ev.op), forward_op))
    if arg is None or not ev.inputs:
        return None
    names = tensor_arg_names(str(ev.op), len(ev.inputs))
    if names.count(arg) != 1:
        return None
    found = ev.inputs[names.index(arg)]
    if not isinstance(found, dict) or not str(found.get("dtype", "")).startswith(("float", "bfloat")):
        return None  # (a complex x: the formula reads conj(x), not x)
    return [dict(found)]
