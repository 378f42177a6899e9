"""Silent broadcasting in a loss: `mse_loss(pred[B, 1], y[B])` compares every prediction with every target (a
B×B loss) and trains on nonsense without an error. Flagged in every analysis, healthy or not, from the step
program: a loss op (or an elementwise op run inside the loss) whose inputs — followed back through the `expand`s
that `broadcast_tensors` inserted — broadcast to a shape larger than each of them."""

from __future__ import annotations

import math

from nanreplay.formats.program import Ref, node_outputs

_LOSS_OPS = frozenset({"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                       "binary_cross_entropy_with_logits", "soft_margin_loss", "kl_div", "poisson_nll_loss"})
_ELEMENTWISE = frozenset({"sub", "rsub", "add", "mul", "div", "pow", "abs", "square", "sub_", "add_", "mul_",
                          "div_", "xlogy", "maximum", "minimum"})


def _broadcast(shapes: list[list[int]]) -> list[int] | None:
    n = max(len(s) for s in shapes)
    out = []
    for dims in zip(*[[1] * (n - len(s)) + list(s) for s in shapes], strict=True):
        big = {d for d in dims if d != 1}
        if len(big) > 1:
            return None
        out.append(big.pop() if big else 1)
    return out


def find(program) -> list[dict]:
    """Each op whose inputs broadcast to more elements than any of them holds: op, shapes, module, line."""
    shape: dict[int, list[int]] = {lf.ref: list(lf.shape) for lf in program.leaves}
    origin: dict[int, list[int]] = {}  # an expand's output -> the shape it was expanded from
    found = []
    for i, node in enumerate(program.nodes):
        outs = node_outputs(node)
        for r, (s, _dt) in zip(outs, node.meta, strict=False):
            shape[r] = list(s)
        base = node.name.split(".")[1] if node.name.count(".") >= 2 else node.name
        ins = [int(a) for a in node.args[:2] if isinstance(a, Ref)]
        if base == "expand" and ins and outs:
            origin[outs[0]] = origin.get(ins[0], shape.get(ins[0], []))
            continue
        in_loss = program.modules[node.module] == "<loss>"
        if len(ins) < 2 or not (base in _LOSS_OPS or (in_loss and base in _ELEMENTWISE)):
            continue
        src = [origin.get(r, shape.get(r)) for r in ins]
        if any(s is None for s in src) or any(math.prod(s) <= 1 for s in src) or src[0] == src[1]:
            continue
        out = _broadcast(src)
        if out is None or math.prod(out) <= max(math.prod(s) for s in src):
            continue
        frame = program.frames[node.frame] if node.frame is not None else None
        found.append({"node": i, "op": node.name, "shapes": src, "broadcast_to": out,
                      "module": program.modules[node.module],
                      "source": {"file": frame["file"], "line": frame["line"], "code": frame["code"]} if frame else None,
                      "message": f"{node.name} broadcasts {src[0]} with {src[1]} to {out}: every element of one is "
                                 f"paired with every element of the other (a shape bug: e.g. predictions "
                                 f"[B, 1] against targets [B]; squeeze or reshape one of them)"})
    return found
