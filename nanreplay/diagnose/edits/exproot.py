"""Root, not site, for exp: a log-scale value (a VAE's log-variance) that more than one exp takes.

`std = torch.exp(0.5 * logvar)` in the model and `logvar.exp()` in the KL term: a clamp of the first exp's input
leaves the second overflowing, the replay stays non-finite and nothing verifies. The value both exps take is
`logvar` itself, made once (`mu, logvar = self.mu(h), self.logvar(h)`): clamped there, at the bound every exp of
it needs (exp(c * x) stays finite for x ≤ bound / c), every use is fixed at once, and the no-op check is made at
the exps (where the original was finite, they must not move).
"""

from __future__ import annotations

import math

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.model import Fix
from nanreplay.diagnose.site import Site, _passes_through, library_of, packet
from nanreplay.enums import FixKind
from nanreplay.replay import OpRecord, frame_json

ast = codefix.ast
_SCALE = ("aten.mul", "aten.div", "aten.neg")  # x * c, x / c, -x: a tensor and a number
# the whole value, reshaped or copied (not a part of it: a split, a slice, an index)
_WHOLE = ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.clone", "aten.contiguous", "aten.alias",
          "aten._to_copy", "aten.squeeze", "aten.unsqueeze", "aten.t", "aten.transpose", "aten.permute", "aten.detach")


def _scaled(r: OpRecord) -> bool:
    return packet(str(r.op)) in _SCALE and sum(x is not None for x in r.src) == 1 and not (r.leaves and any(r.leaves))


_METHODS = ("mul", "multiply", "div", "divide", "true_divide", "neg", "negative")


def _name(node) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _coefficient(node) -> float | None:
    """c of the exponent c * x as written (`0.5 * logvar`, `-alpha`, `logvar / 2`, `logvar.mul(0.5)`, `logvar`), or
    None where it is not a number times the value (`logvar + 1`, a clamp)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _METHODS:
        c = _coefficient(node.func.value)  # x.mul(0.5), x.div(2), x.neg()
        if node.func.attr in ("neg", "negative"):
            return -c if c is not None and not node.args else None
        try:
            v = ast.literal_eval(node.args[0]) if len(node.args) == 1 and not node.keywords else None
        except (ValueError, TypeError, SyntaxError):
            return None
        if c is None or not isinstance(v, (int, float)) or isinstance(v, bool) or v == 0:
            return None
        return c * v if node.func.attr in ("mul", "multiply") else c / v
    if isinstance(node, ast.Call) and _name(node) in _METHODS + ("add", "sub", "subtract", "rsub", "clamp"):
        return None  # an arithmetic call this reading does not follow
    if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)):
        return 1.0
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        c = _coefficient(node.operand)
        return -c if c is not None else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        for num_, rest, div in ((node.left, node.right, False), (node.right, node.left, isinstance(node.op, ast.Div))):
            try:
                v = ast.literal_eval(num_)
            except (ValueError, TypeError, SyntaxError):
                continue
            if isinstance(node.op, ast.Div) and num_ is node.left:
                return None  # c / x is not a scaling of x
            c = _coefficient(rest)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0 and c is not None:
                return c / v if div else c * v
        return None
    return None


def _exp_coefficient(s: Site, e: OpRecord) -> float | None:
    src = s.source_of(e.call)
    loc = codefix.locate(src, src["line"], s.name_of(e.call), ordinal=s.ordinal(e.call)) if src else None
    if loc is None or not isinstance(loc.node, ast.Call):
        return None
    x = codefix.operand(loc.node, "input")
    return _coefficient(x) if x is not None else None


def _exps_of(s: Site, root: int, depth: int = 0) -> list[OpRecord] | None:
    """The exps that take op `root`'s value through views and scalings; None where it also reaches an exp some
    other way (through an op that is neither)."""
    out = []
    for i in s.consumers(root):
        r = s.step.ops[i]
        if packet(str(r.op)) == "aten.exp":
            out.append(r)
        elif depth < 4 and (_passes_through(r) or _scaled(r)):
            more = _exps_of(s, i, depth + 1)
            if more is None:
                return None
            out += more
    return out


def _module_output(s: Site, root: OpRecord) -> str | None:
    """`logvar` where the root is the output of the submodule `self.logvar` (a Linear's addmm, nothing but views of
    it after it in that module): the call the user wrote on the line that made it."""
    if not root.module or root.module == "<loss>":
        return None
    i = s.index(root)
    nxt = s.step.ops[i + 1] if i + 1 < len(s.step.ops) else None
    if nxt is not None and (nxt.module == root.module or nxt.module.startswith(root.module + ".")) \
            and not _passes_through(nxt):
        return None  # the module computes more after it: its output is not this value
    return root.module.rsplit(".", 1)[-1]


def _applied(fn):
    """The call's output changed as the rewritten code shows (a call with several outputs is left as it is)."""
    def at(func, args, kwargs):
        out = func(*args, **kwargs)
        return fn(out) if isinstance(out, torch.Tensor) else out
    return at


def _fmt(v: float) -> str:
    return f"{v:g}"


def root_clamps(s: Site, bounds: list[int]) -> list[Fix]:
    """Clamps of the value every exp takes, where it is made: one candidate per bound of the exponent (the
    tightest exp decides), first. Empty where the culprit's exp is the value's only exp, or where a coefficient
    or the line that makes it cannot be read."""
    r = s.src(0)
    while r is not None and (_scaled(r) or packet(str(r.op)) in _WHOLE) and r.src:
        r = s.src(0, r)
    if r is None or not r.call or getattr(r.op, "is_view", False):
        return []  # a part of a value (mu, logvar = h.chunk(2)): clamped where it is made, mu would be clamped too
    exps = _exps_of(s, s.index(r))
    if not exps or len(exps) < 2 or s.rec not in exps or not all(e.call for e in exps):
        return []
    coefs = [_exp_coefficient(s, e) for e in exps]
    if any(c is None or c == 0 for c in coefs):
        return []
    src = s.source_of(r.call)
    attr = _module_output(s, r)
    fr = frame_json(r.frame)
    at = f"{fr['file']}:{fr['line']}" if fr else "where it is made"
    uses = ", ".join(dict.fromkeys(f"{f['file']}:{f['line']}" for e in exps if (f := frame_json(e.frame))))
    fixes = []
    for b in bounds:
        hi = min((b / c for c in coefs if c > 0), default=None)
        lo = max((b / c for c in coefs if c < 0), default=None)
        args = ", ".join(x for x in (f"min={_fmt(lo)}" if lo is not None else "",
                                     f"max={_fmt(hi)}" if hi is not None else "") if x)

        def change(t: str, args=args) -> str:
            return f"{codefix.paren(t)}.clamp({args})"
        rw = s.rewrite(lambda sr, node, change=change: change(sr(node)), r.call)
        if rw is None and attr and src and not library_of(src.get("recorded_path") or src.get("file") or ""):
            rw = codefix.rewrite(src, src["line"], f"self.{attr}", lambda sr, node, change=change: change(sr(node)))
        fn = codefix.compile_operand(change(codefix.PLACEHOLDER))
        if fn is None:
            return []
        calls = s.line_calls(r.call) if rw is not None and not attr else [r.call]
        patch = {c: _applied(fn) for c in calls}
        # compared at the exps that bind (the largest coefficient of each sign): where they were finite the clamp
        # does not bite, so nothing moves anywhere; where it bites, they overflowed, and an exp of a smaller
        # coefficient that moves there is the same element of the same value (exp(0.5 x) of the x whose exp(x) was inf)
        top = (max((c for c in coefs if c > 0), default=None), min((c for c in coefs if c < 0), default=None))
        binding = [e for e, c in zip(exps, coefs, strict=True) if c in top]
        exps_at = sorted({c for e in binding for c in (s.line_calls(e.call) if rw is not None else [e.call])})
        fixes.append(Fix(
            FixKind.CLAMP, "", rewrite=rw, patch=patch, compare_at=exps_at,
            guidance=f"clamp the value that every exp takes where it is made ({at}): .clamp({args}); it is "
                     f"exponentiated at {uses}",
            reasoning=f"exp(x) overflows {s.dtype} above x ≈ {math.log(s.finfo.max):.1f}; the same value is "
                      f"exponentiated at {uses} (exp of {', '.join(_fmt(c) + ' x' for c in coefs)}): clamped where it "
                      f"is made ({at}), every exponent stays at most {b}, and every use sees the same value"))
    return fixes
