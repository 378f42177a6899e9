"""The log of a product of probabilities that underflowed to 0 (the reformulation table's `log_of_product` row).

A sequence's or a combination's likelihood written as `p.prod(d)` (a survival curve as `cumprod`) and then
logged: with enough factors the product is below the dtype's smallest number and rounds to exactly 0 even though
no factor is 0, and log(0) = -inf. The exact form is the sum of the logs, `torch.log(p).sum(d)` (`.cumsum(d)` for
a cumprod): the same value wherever the product did not underflow, finite where it did. The product may be made
on an earlier line (`likelihood = p.prod(dim=1)`, then `-torch.log(likelihood)`): that line then makes
`log_likelihood = torch.log(p).sum(dim=1)` and the log's line reads it (crossline.Definitions). A factor that is
exactly 0 keeps the sum -inf: the replay of the exact form then fails, and the ε the log-of-zero rule would give
is the next candidate.
"""

from __future__ import annotations

import torch

from nanreplay.diagnose.edits import codefix, crossline
from nanreplay.diagnose.fixes import edge_fix, nonneg_eps
from nanreplay.diagnose.forms import TABLE
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.rules.forms import _at, _line, _name, _swap
from nanreplay.diagnose.site import Site, packet
from nanreplay.enums import FixKind

aten = torch.ops.aten
ast = codefix.ast


_SUMS = {"prod": "sum", "cumprod": "cumsum"}


def _sum_of_logs(src, prod) -> str | None:
    """`X.prod(d)` / `torch.prod(X, d)` -> `torch.log(X).sum(d)`; `X.cumprod(d)` -> `torch.log(X).cumsum(d)`."""
    if not (isinstance(prod, ast.Call) and _name(prod) in _SUMS):
        return None
    x = codefix.operand(prod, "input")
    if x is None:
        return None
    rest = [src(a) for a in codefix.arguments(prod)] + [f"{k.arg}={src(k.value)}" for k in prod.keywords]
    return f"torch.log({src(x)}).{_SUMS[_name(prod)]}({', '.join(rest)})"


def _text(src, node, defs: crossline.Definitions) -> str | None:
    """torch.log(X.prod(d)) -> torch.log(X).sum(d); torch.log(name) where `name = X.prod(d)` was assigned above
    -> `log_name`, that line becoming `log_name = torch.log(X).sum(d)` (a second edit)."""
    if _name(node) != "log":
        return None
    inner = codefix.operand(node, "input")
    direct = _sum_of_logs(src, inner)
    if direct is not None:
        return direct
    if not isinstance(inner, ast.Name):
        return None
    d = defs.find(inner.id)
    body = _sum_of_logs(d.src, d.value) if d is not None else None
    if body is None:
        return None
    new = defs.fresh(f"log_{inner.id}")
    defs.replace(d, [f"{new} = {body}"] + ([f"{inner.id} = torch.exp({new})"] if d.reused else []))
    return new


def _stable(cumulative: bool):
    """What the rewritten line computes, from prod's own arguments: prod(input, dim, keepdim, dtype=) and
    sum(input, dim, keepdim, dtype=) take the same ones, as cumprod(input, dim, dtype=) and cumsum do."""
    def f(args, kwargs):
        return (torch.cumsum if cumulative else torch.sum)(torch.log(args[0]), *args[1:], **kwargs)
    return f


@rule("log_of_product_underflow", aten.log, priority=184)  # after logsumexp_underflow (185), before log_of_zero
def _log_of_product(s: Site) -> Diagnosis | None:
    x = s.inp(0)
    if not (s.forward and s.event.kind == "inf" and s.call_is("log") and x.get("zeros") and not x.get("negatives")):
        return None
    prod = s.origin(0)
    if prod is None or packet(str(prod.op)) not in ("aten.prod", "aten.cumprod") or not prod.call:
        return None
    row = TABLE["log_of_product"]
    defs = crossline.Definitions(s.source, (s.source or {}).get("line"))
    rw = defs.attach(s.rewrite(lambda src, node: _text(src, node, defs)))
    if rw is not None and rw.extra and not crossline.covers(rw, [_line(prod)]):
        rw = None  # the product is not on the line the edit changes
    patch = _swap(s, prod, s.rec, _stable(packet(str(prod.op)) == "aten.cumprod"), rw is not None)
    if patch is None:
        return None
    eps = edge_fix(s, FixKind.EPSILON, x.get("absmax"), "log(x + eps) and its gradient 1/(x + eps)",
                   *nonneg_eps(s, "log's input"), floor=1 / s.finfo.max, floor_why="the gradient 1/(x + eps)",
                   data_eps=x.get("absmin_nonzero"))
    return Diagnosis(
        "log_of_product_underflow", "log of a product of probabilities that underflowed to 0",
        f"the product at {_at(prod)} multiplies many factors below 1; in {s.dtype} a product under about "
        f"{s.finfo.tiny:.1e} (and the subnormals below it) rounds to exactly 0, so log(0) = -inf at {s.where}, "
        f"although no factor need be 0. The exact value is finite: {row.exact}, the sum of the logs. An ε inside "
        "the log would cap that sample's loss at -log(ε), take away its gradient, and move every product that is "
        "small but not 0.",
        [Fix(row.kind, "", rewrite=rw, patch=patch, reasoning=row.why,
             guidance=f"take the log of each factor and sum them ({row.exact}) instead of the log of the product "
                      f"at {s.where}"), *eps])
