"""A quantity that must be positive (a rate, a scale, a std, a norm) made non-negative by a ReLU, then logged or
divided by: the edge is not a rounding accident but the parametrisation itself. `relu(z)` is exactly 0 for every
z <= 0 (half the real line), its gradient there is 0, so a unit that went dead never comes back, and an ε at the log
only turns log(0) into log(ε) with no gradient (the loss moves with ε, and the replay says so). The fix is a
positive parametrisation where the value is made: `F.softplus(z)` (strictly positive, smooth, ≈ z for large z,
gradient sigmoid(z) > 0 everywhere), written as an edit of the line that calls the ReLU.

Found by following the culprit's operand back through views and copies to a `relu` / `clamp(min=0)` /
`clamp_min(0)` call or a `z * (z > 0)` made on a line of the user's (`lam = F.relu(self.rate(h)).squeeze(-1)`),
which may be another line than the culprit's (the log inside torch.distributions' log_prob reaches the scale the
user made). The
replay runs the edited line at every call it makes. The no-op check does not apply: softplus is another function
of the same pre-activation (softplus(1) = 1.31), so every value changes by design; the replay is judged by its loss
and gradients, against the history. An `nn.ReLU()` module (its relu runs inside torch) is named in words.
"""

from __future__ import annotations

import ast

import torch.nn.functional as F

from nanreplay.diagnose.edits import codefix, construction
from nanreplay.diagnose.model import Fix
from nanreplay.diagnose.site import Site, packet
from nanreplay.enums import FixKind
from nanreplay.replay import OpRecord, frame_json

_RELUS = ("aten.relu", "aten.clamp_min", "aten.clamp")
_ROOTS = ("aten.sqrt", "aten.rsqrt")

WHY_EXEMPT = "softplus changes every value by design (it is > relu near 0); judged by its loss and gradients"


def relu_origin(s: Site, arg: int) -> OpRecord | None:
    """The ReLU-like op (relu, clamp at 0: the edit checks the 0 in the code) that made the culprit's `arg`-th
    operand, looking through views and copies and through one sqrt/rsqrt of it; None where anything else made it."""
    r = s.origin(arg)
    if r is not None and packet(str(r.op)) in _ROOTS:  # x / sqrt(relu(v)): the root of a ReLU's output
        r = s.origin(0, r)
    if r is not None and packet(str(r.op)) == "aten.mul" and len(r.src) == 2 and \
            sum(s.origin_packet(i, r) == "aten.gt" for i in range(2)) == 1:
        return r  # z * (z > 0): the edit checks the text is exactly that
    if r is None or packet(str(r.op)) not in _RELUS:
        return None
    return r


def _zero(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and \
        not isinstance(node.value, bool) and node.value == 0


def _masked_input(node: ast.AST) -> ast.AST | None:
    """z of `z * (z > 0)` / `(z > 0) * z` (the comparison maybe `.float()`-ed), the same text on both sides."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return None
    for z, m in ((node.left, node.right), (node.right, node.left)):
        if isinstance(m, ast.Call) and isinstance(m.func, ast.Attribute) and m.func.attr in ("float", "type_as") \
                and not m.keywords:
            m = m.func.value
        if isinstance(m, ast.Compare) and len(m.ops) == 1 and isinstance(m.ops[0], ast.Gt) and \
                _zero(m.comparators[0]) and ast.dump(m.left) == ast.dump(z):
            return z
    return None


def _relu_input(node: ast.AST) -> ast.AST | None:
    """The pre-activation z of `F.relu(z)` / `torch.relu(z)` / `z.relu()` / `z.clamp(min=0)` / `torch.clamp(z,
    min=0)` / `z.clamp_min(0)`: a call that makes exactly max(z, 0); None for anything else (a max too, inplace)."""
    if isinstance(node, ast.BinOp):
        return _masked_input(node)
    if not isinstance(node, ast.Call):
        return None
    name = codefix._callee(node)
    fn = codefix._is_function_call(node)
    z = node.args[0] if fn and node.args else (node.func.value if not fn and isinstance(node.func, ast.Attribute)
                                               else None)
    rest = node.args[1:] if fn else node.args
    kw = {k.arg: k.value for k in node.keywords}
    if z is None:
        return None
    if name == "relu":
        return z if not rest and not kw else None
    if name == "clamp_min":
        lo = rest[0] if rest else kw.get("min")
        return z if _zero(lo) and len(rest) + len(kw) == 1 else None
    if name == "clamp":
        lo = rest[0] if rest else kw.get("min")
        hi = rest[1] if len(rest) > 1 else kw.get("max")
        return z if _zero(lo) and (hi is None or isinstance(hi, ast.Constant) and hi.value is None) else None
    return None


def positive_fixes(s: Site, arg: int, what: str) -> list[Fix]:
    """The softplus edit of the line whose ReLU made the culprit's `arg`-th operand, replayed at every call that
    line makes; `what` names the use ("log's input", "the divisor"). Empty where no ReLU made it."""
    r = relu_origin(s, arg)
    if r is None or not r.call:
        return []
    src = s.source_of(r.call)
    fn = codefix.functional(src or s.source)

    def transform(text, node):
        z = _relu_input(node)
        return f"{fn}.softplus({text(z)})" if z is not None else None
    rw = s.rewrite(transform, r.call)
    fr = frame_json(r.frame)
    at = f"{fr['file']}:{fr['line']}" if fr else s.where
    why = (f"{what} is made non-negative by a ReLU at {at}: relu(z) is exactly 0 for every z <= 0 and passes no "
           "gradient there, so once the pre-activation is negative the value is 0, log/divide gives -inf/Inf, and "
           "an ε only swaps that for log(ε) with no gradient back (the unit stays dead). softplus(z) = log(1 + e^z) "
           "is strictly positive, ≈ z for large z, and its gradient sigmoid(z) never vanishes, so the quantity "
           "recovers by training; torch.exp(z) is the other usual positive parametrisation (it can overflow)")

    z = next((i for i in range(len(r.src)) if s.origin_packet(i, r) != "aten.gt"), 0)  # z * (z > 0): z's place

    def softplus(func, args, kwargs):
        return F.softplus(args[z])
    if rw is not None:
        return [Fix(FixKind.POSITIVE_PARAMETRISATION, "", rewrite=rw, patch=s.at_calls(softplus, r.call, rw),
                    reasoning=why, noop_exempt=WHY_EXEMPT, alternatives=[f"torch.exp(...) in place of the ReLU at {at}"])]
    if packet(str(r.op)) != "aten.relu" or not r.module:
        return []
    mod = r.module  # an nn.ReLU module: its relu runs inside torch, the edit is where the module is made
    built = construction.replace_child(getattr(s.subject, "constructions", None), r, "ReLU", "Softplus")
    if built is not None:  # a child of an nn.Sequential(...) the guard saw built: that statement, ReLU -> Softplus
        return [Fix(FixKind.POSITIVE_PARAMETRISATION, "", rewrite=built, patch={r.call: softplus}, reasoning=why,
                    noop_exempt=WHY_EXEMPT, tested_as="op")]
    return [Fix(FixKind.POSITIVE_PARAMETRISATION, "", patch={r.call: softplus}, reasoning=why,
                noop_exempt=WHY_EXEMPT,
                guidance=f"make the module {mod!r} an nn.Softplus() instead of nn.ReLU() where the model builds it: "
                         f"it makes {what}, which must stay positive")]
