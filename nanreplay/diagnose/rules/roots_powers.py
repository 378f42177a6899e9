"""Roots, powers and inverse trig at the edge of their domain: sqrt, x ** a, acos / asin.
sqrt_cancellation outranks sqrt_of_negative: both claim a negative under sqrt, and a variance
computed as E[x²] − E[x]² is the more specific story (and the better fix)."""

from __future__ import annotations

import math

import torch

from nanreplay import replay
from nanreplay.diagnose.edits import codefix, posfix
from nanreplay.diagnose.fixes import HALF, clamp_eps, edge_fix, fmt, nonneg_eps, operand_fn, plus_eps, replace_arg
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.prose import count, count_in
from nanreplay.diagnose.site import Site, finite_float, packet
from nanreplay.enums import FixKind
from nanreplay.stats import num

aten = torch.ops.aten


def _sqrt_call(s: Site) -> bool:
    return s.packet == "aten.sqrt" and s.call_is("sqrt")


def _cancelling_sub(s: Site):
    """The E[x²] − E[x]² under sqrt, looking through `+ eps`: sqrt(var) or sqrt(var + 1e-5)."""
    r = s.origin(0)
    if r is not None and packet(str(r.op)) == "aten.add":
        terms = [i for i in range(len(r.src)) if r.src[i] is not None]
        r = s.origin(terms[0], r) if len(terms) == 1 else None  # var + a constant
    return r if r is not None and packet(str(r.op)) == "aten.sub" else None


@rule("sqrt_cancellation", aten.sqrt, priority=160)
def _sqrt_cancel(s: Site) -> Diagnosis | None:
    """sqrt(E[x^2] - E[x]^2 (+ eps)): rounding makes a zero variance slightly negative."""
    x = s.inp(0)
    sub = _cancelling_sub(s)
    if not (s.forward and _sqrt_call(s) and x.get("negatives", 0)) or sub is None:
        return None
    # A zero variance computed as a difference comes out as rounding noise: |noise| ≈ eps(dtype) * E[x²].
    # So the negatives tell the scale of the terms that cancelled.
    lo = abs(finite_float(x.get("min")) or 0.0)
    terms = lo / s.finfo.eps
    scale = max(finite_float(x.get("absmax")) or 0.0, terms)
    fixes = _stable_variance(s, sub)
    fixes += edge_fix(s, FixKind.CLAMP, scale, "sqrt(var.clamp_min(0) + eps) and its gradient 1/(2*sqrt(eps))",
                      lambda t, e: f"{codefix.paren(t)}.clamp_min(0) + {fmt(e)}",
                      lambda t, e: t.clamp_min(0) + e, lambda e: f"clamp the variance at 0 and add {fmt(e)} before sqrt")
    return Diagnosis("sqrt_cancellation", "sqrt of a variance computed as E[x²] − E[x]²",
                     f"sqrt's input is a difference with {count_in(x['negatives'], 'negative value', x)} "
                     f"(min {num(x.get('min'))}): "
                     f"computed as E[x²] − E[x]², a zero variance (a constant feature) cancels to rounding noise of "
                     f"about {s.dtype}'s eps × E[x²] (here E[x²] is of order {terms:.2g}), which can be negative "
                     f"— more negative than any eps added to it — and sqrt of a negative is NaN at {s.where}. Compute "
                     "the variance with torch.var(x, dim, correction=0), which does not cancel; clamping at 0 only "
                     "hides the bug.", fixes)


def _square_of(node) -> object | None:
    """x in `x * x`, `x ** 2`, `x.pow(2)`, `torch.square(x)`; else None."""
    ast = codefix.ast
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and ast.dump(node.left) == ast.dump(node.right):
        return node.left
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and isinstance(node.right, ast.Constant) \
            and node.right.value == 2:
        return node.left
    if isinstance(node, ast.Call) and codefix._callee(node) in ("pow", "square"):
        rest = codefix.arguments(node)
        if codefix._callee(node) == "square" or (rest and isinstance(rest[0], ast.Constant) and rest[0].value == 2):
            return codefix.operand(node, "input")
    return None


def _var_text(src, node) -> tuple[str, str] | None:
    """`(x * x).mean(0) - mu * mu` -> ('torch.var(x, 0, correction=0)', the same with x as `__x`)."""
    ast = codefix.ast
    if not isinstance(node, ast.BinOp) or not isinstance(node.op, ast.Sub):
        return None
    mean = node.left
    if not isinstance(mean, ast.Call) or codefix._callee(mean) != "mean":
        return None
    x = _square_of(codefix.operand(mean, "input"))
    if x is None:
        return None
    rest = [src(a) for a in codefix.arguments(mean)] + [f"{k.arg}={src(k.value)}" for k in mean.keywords]
    tail = "".join(f", {r}" for r in rest) + ", correction=0"
    # what is executed is rebuilt from the literal values, never from the source text itself
    values = [_literal(a) for a in codefix.arguments(mean)] + [_literal(k.value) for k in mean.keywords]
    ok = all(v is not _NOT_LITERAL for v in values) and all(k.arg in ("dim", "keepdim") for k in mean.keywords)
    names = [""] * len(codefix.arguments(mean)) + [f"{k.arg}=" for k in mean.keywords]
    run = "".join(f", {n}{v!r}" for n, v in zip(names, values, strict=True)) + ", correction=0"
    return f"torch.var({src(x)}{tail})", (f"torch.var({codefix.PLACEHOLDER}{run})" if ok else "")


_NOT_LITERAL = object()


def _literal(node):
    try:
        v = codefix.ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return _NOT_LITERAL
    ok = isinstance(v, (bool, int)) or (isinstance(v, tuple) and all(isinstance(d, int) for d in v))
    return v if ok else _NOT_LITERAL


def _stable_variance(s: Site, sub) -> list[Fix]:
    """torch.var(x, dims, correction=0) in place of E[x²] − E[x]², verified by computing it from the x squared."""
    mean = s.origin(0, sub)
    sq = s.origin(0, mean) if mean is not None and packet(str(mean.op)) == "aten.mean" else None
    if sq is None or packet(str(sq.op)) not in ("aten.mul", "aten.pow") or not (sq.call and mean.call and sub.call) \
            or len({sq.call, mean.call, sub.call}) != 3:
        return []
    shown: dict = {}

    def text(src, node):
        got = _var_text(src, node)
        if got is not None:
            shown["exec"] = got[1]
        return got[0] if got else None
    rw = s.rewrite(text, sub.call)
    run = codefix.compile_operand(shown["exec"]) if rw is not None and shown.get("exec") else None
    state: dict = {}

    def grab_x(func, args, kwargs):
        state["x"] = args[0]
        return func(*args, **kwargs)

    def grab_dims(func, args, kwargs):
        state["dim"] = args[1] if len(args) > 1 else kwargs.get("dim")
        state["keepdim"] = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        return func(*args, **kwargs)

    def var(func, args, kwargs):
        if run is not None:
            return run(state["x"])
        return torch.var(state["x"], state["dim"], correction=0, keepdim=state["keepdim"])
    each = s.line_calls if rw is not None else (lambda c: [c])
    patch = {**{c: grab_x for c in each(sq.call)}, **{c: grab_dims for c in each(mean.call)},
             **{c: var for c in each(sub.call)}}
    fr = replay.frame_json(sub.frame)
    where = f"{fr['file']}:{fr['line']}" if fr else "where the variance is computed"
    return [Fix(FixKind.STABLE_VARIANCE, "", rewrite=rw, patch=patch,
                guidance=f"compute the variance at {where} with torch.var(x, dim, correction=0) instead of E[x²] − E[x]²",
                noop_exempt="the original's variances are cancellation noise (that is the bug), so they are not the "
                            "values to keep",
                reasoning="torch.var subtracts the mean first (two passes): a zero variance comes out as 0, never "
                          "below, so nothing has to be clamped")]


@rule("sqrt_of_negative", aten.sqrt, priority=150)
def _sqrt_negative(s: Site) -> Diagnosis | None:
    x = s.inp(0)
    if not (s.forward and _sqrt_call(s) and x.get("negatives", 0)):
        return None
    fixes = edge_fix(s, FixKind.CLAMP, x.get("absmax"), "sqrt and its gradient",
                     lambda t, e: f"{codefix.paren(t)}.clamp_min(0) + {fmt(e)}",
                     lambda t, e: t.clamp_min(0) + e, lambda e: f"clamp sqrt's input at 0 and add {fmt(e)}")
    return Diagnosis("sqrt_of_negative", "sqrt of a negative number",
                     f"sqrt received {count_in(x['negatives'], 'negative value', x)} (min {num(x.get('min'))}) at {s.where}: "
                     "sqrt(x<0) = NaN in forward.", fixes)  # what anomaly mode would do: its own section says


@rule("sqrt_at_zero", aten.sqrt, priority=140)
def _sqrt_zero(s: Site) -> Diagnosis | None:
    if not _sqrt_call(s) or s.forward or s.event.node != "SqrtBackward0":
        return None
    denom = s.inp(1)  # SqrtBackward0: grad / (2 * sqrt(x))
    amax = finite_float(denom.get("absmax"))
    scale = (amax / 2) ** 2 if amax is not None else None
    fixes = posfix.positive_fixes(s, 0, "sqrt's input")  # a ReLU made it: its zeros are the parametrisation's
    fixes += edge_fix(s, FixKind.EPSILON, scale, "the gradient 1/(2*sqrt(x + eps))",
                      *nonneg_eps(s, "sqrt's input"), root_clamp=s.dtype in HALF,
                      floor=(1 / (2 * s.finfo.max)) ** 2, floor_why="the gradient 1/(2*sqrt(eps))",
                      data_eps=(d / 2) ** 2 if (d := finite_float(denom.get("absmin_nonzero"))) else None)
    return Diagnosis("sqrt_at_zero", "sqrt at zero: infinite gradient",
                     f"sqrt's input held exact zeros at {s.where}. sqrt(0) = 0 is fine in forward, but its "
                     "derivative 1/(2*sqrt(x)) is Inf there — the `sqrt(0).backward()` case of \"Debugging Gradients "
                     "That Misbehave\" (often a "
                     "distance or norm between identical vectors).", fixes)


def _exponent(s: Site) -> float | None:
    """The exponent a of x ** a (in backward, PowBackward0 computes x ** (a - 1))."""
    v = next((v for v in s.event.scalars or [] if isinstance(v, (int, float)) and not isinstance(v, bool)), None)
    if v is None:
        return None
    return float(v) if s.forward else float(v) + 1


def _pow_call(s: Site) -> bool:
    return s.packet == "aten.pow" and s.call_is("pow", "__pow__", "float_power")


@rule("pow_of_negative", aten.pow, priority=130)
def _pow_negative(s: Site) -> Diagnosis | None:
    x = s.inp(0)
    a = _exponent(s)
    if not (s.forward and _pow_call(s) and x.get("negatives", 0) and a is not None and a != int(a)):
        return None
    fixes = edge_fix(s, FixKind.CLAMP, x.get("absmax"), f"x ** {a:g} and its gradient",
                     clamp_eps, lambda t, e: t.clamp_min(e), lambda e: f"clamp the base of ** {a:g} to at least {fmt(e)}",
                     floor=(abs(a) / s.finfo.max) ** (1 / (1 - a)) if a < 1 else None,
                     floor_why=f"the gradient {a:g} * eps ** {a - 1:g}", scalars=[a])
    return Diagnosis("pow_of_negative", f"fractional power ({a:g}) of a negative number",
                     f"x ** {a:g} is NaN for x < 0 ({count_in(x['negatives'], 'such value', x)}, min {num(x.get('min'))}) "
                     f"at {s.where}. "
                     "A fractional power is only defined for x ≥ 0: clamp the base (or use "
                     f"x.sign() * x.abs() ** {a:g} if negative inputs are meaningful).", fixes)


@rule("pow_at_zero", aten.pow, priority=120)
def _pow_zero(s: Site) -> Diagnosis | None:
    """x ** a at x = 0: Inf gradient for 0 < a < 1 (PowBackward0), Inf value for a < 0."""
    if not _pow_call(s):
        return None
    a = _exponent(s)
    x = s.inp(0)
    if a is None or a >= 1 or a == 0 or not x.get("zeros", 0):
        return None
    if s.forward:
        if a > 0 or s.event.kind != "inf":
            return None
    elif s.event.node != "PowBackward0":
        return None
    fmax = s.finfo.max
    floor = (abs(a) / fmax) ** (1 / (1 - a)) if a > 0 else (1 / fmax) ** (1 / -a)
    fixes = edge_fix(s, FixKind.EPSILON, x.get("absmax"),
                     f"(x + eps) ** {a:g} and its gradient {a:g} * (x + eps) ** {a - 1:g}",
                     *(nonneg_eps(s, f"the base of ** {a:g}") if a != int(a) else
                       (plus_eps, lambda t, e: t + e, lambda e: f"add {fmt(e)} to the base of ** {a:g}")),
                     floor=floor, floor_why=f"{'the gradient ' if a > 0 else ''}eps ** {a - 1 if a > 0 else a:g}",
                     scalars=[a], data_eps=x.get("absmin_nonzero"))
    if a > 0:
        title, what = (f"x ** {a:g} at x = 0: infinite gradient",
                       f"x ** {a:g} is 0 at x = 0, but its derivative {a:g} * x ** {a - 1:g} has a negative power, "
                       f"so it is Inf there")
    else:
        title, what = f"x ** {a:g} at x = 0: infinite value", f"x ** {a:g} = 1 / x ** {-a:g} is Inf at x = 0"
    return Diagnosis("pow_at_zero", title,
                     f"{what} ({count(x.get('zeros', 0), 'exact zero')} in x, {s.where}). Add a small eps to the base.", fixes)


@rule("acos_asin_boundary", aten.acos, aten.asin, priority=110)
def _acos(s: Site) -> Diagnosis | None:
    name = s.packet.split(".")[1]
    if not s.call_is(name, "arccos", "arcsin"):
        return None
    x = s.inp(0)
    # 1 - eps must be a value the dtype can tell apart from 1 (the spacing just below 1 is finfo.eps / 2);
    # there the derivative 1/sqrt(1 - x²) ≈ 1/sqrt(2 eps) is large but finite.
    eps = float(f"{10.0 ** math.ceil(math.log10(s.finfo.eps)):.0e}")
    tight = float(f"{s.finfo.eps / 2:.0e}")  # the spacing just below 1: changes only values at or beyond ±1
    fixes = []
    for e in (tight, eps, eps * 10, eps * 100):
        lo, hi = f"-1 + {fmt(e)}", f"1 - {fmt(e)}"
        rw = s.rewrite(codefix.with_operand("input", lambda t, lo=lo, hi=hi: f"{codefix.paren(t)}.clamp({lo}, {hi})"))
        fn = operand_fn(rw) or (lambda t, e=e: t.clamp(-1 + e, 1 - e))
        fixes.append(Fix(FixKind.CLAMP, "", epsilon=e, rewrite=rw,
                         guidance=f"clamp {name}'s input to [{lo}, {hi}] at {s.where}",
                         patch=s.at_calls(replace_arg(0, fn), rewrite=rw),
                         reasoning=f"the derivative ∓1/sqrt(1 - x²) is Inf at |x| = 1 and {name} is NaN beyond; "
                                   f"{s.dtype} tells 1 - {fmt(e)} apart from 1 (its spacing below 1 is "
                                   f"{s.finfo.eps / 2:.1e}), so the clamped input keeps value and gradient finite"))
    if s.forward:
        expl = (f"{name} received {s.event.out.get('nan', 0)} values outside [-1, 1] (x range seen: {num(x.get('min'))} .. "
                f"{num(x.get('max'))}) at {s.where}, so it is NaN there — typically a cosine computed by hand that rounding "
                "pushed to 1.0000001.")
    else:
        expl = (f"{name}'s input was exactly ±1 at {s.where}: {name}(±1) is finite, but its derivative "
                f"∓1/sqrt(1 - x²) is Inf there (in {s.event.node}). Typical sources: a clamp(-1, 1) that pins values "
                "to the boundary, a saturated tanh, the cosine of identical vectors.")
    return Diagnosis("acos_asin_boundary", f"{name} at the edge of its domain", expl, fixes)
