"""Compositions that have an exact stable form (the reformulation table, diagnose/forms.py): log(1 + exp(x)),
a weighted log-sum-exp that underflowed, log(1 - exp(x)), x * log(y) at 0, CTC with an infeasible target, and a
relative error over a zero target (whose remedy is in the data). Each rule takes its fix kind and reasoning from
its table row; the exact form is offered before any ε, replayed by a patch that computes exactly what the
rewritten line shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanreplay.diagnose.edits import codefix, crossline, segfix
from nanreplay.diagnose.forms import TABLE
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.prose import count
from nanreplay.diagnose.rules.division import count_source
from nanreplay.diagnose.site import Site, packet
from nanreplay.replay import OpRecord, frame_json
from nanreplay.stats import num

aten = torch.ops.aten
ast = codefix.ast


def _name(node) -> str:
    f = node.func if isinstance(node, ast.Call) else None
    return (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) if f is not None else ""


def _line(rec: OpRecord) -> int | None:
    fr = frame_json(rec.frame)
    return fr["line"] if fr else None


def _at(rec: OpRecord) -> str:
    fr = frame_json(rec.frame)
    return f"{fr['file']}:{fr['line']}" if fr else "where it is computed"


def _swap(s: Site, first: OpRecord, last: OpRecord, stable: Callable[[tuple, dict], torch.Tensor],
          line: bool) -> dict | None:
    """Patches for f(...first(x)...) -> stable(x): remember `first`'s arguments at its call, answer `last`'s call
    with stable(them). `line`: at every call the rewritten line's expressions make (else the recorded calls)."""
    if not (first.call and last.call) or first.call == last.call:
        return None
    state: dict = {}

    def grab(func, args, kwargs):
        state["a"] = (args, kwargs)
        return func(*args, **kwargs)

    def swap(func, args, kwargs):
        return stable(*state.pop("a")) if "a" in state else func(*args, **kwargs)
    each = s.line_calls if line else (lambda c: [c])
    return {**{c: grab for c in each(first.call)}, **{c: swap for c in each(last.call)}}


# ------------------------------------------------------------------ log(1 + exp(x)) -> softplus(x)


def _exp_arg(node) -> ast.AST | None:
    """x of exp(x) / x.exp()."""
    return codefix.operand(node, "input") if isinstance(node, ast.Call) and _name(node) == "exp" else None


def _softplus_text(src, node, Fn: str) -> str | None:
    """torch.log(1 + torch.exp(x)) / (1 + x.exp()).log() / torch.log1p(torch.exp(x)) -> F.softplus(x)."""
    inner = codefix.operand(node, "input")
    if _name(node) == "log1p":
        x = _exp_arg(inner)
    elif _name(node) == "log" and isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Add):
        sides = [(inner.left, inner.right), (inner.right, inner.left)]
        x = next((_exp_arg(e) for one, e in sides if isinstance(one, ast.Constant) and one.value == 1
                  and _exp_arg(e) is not None), None)
    else:
        x = None
    return f"{Fn}.softplus({src(x)})" if x is not None else None


@rule("softplus", aten.exp, priority=65)
def _softplus(s: Site) -> Diagnosis | None:
    """exp(x) overflowed inside log(1 + exp(x)): softplus is the same function, exact for every x."""
    if not (s.forward and s.call_is("exp") and s.event.kind == "inf"):
        return None
    log = None
    for i in s.consumers():
        r = s.step.ops[i]
        if packet(str(r.op)) == "aten.log1p":
            log = r
        elif packet(str(r.op)) == "aten.add" and len(r.src) == 1:  # 1 + exp(x): the other operand a number
            log = next((s.step.ops[j] for j in s.consumers(i) if packet(str(s.step.ops[j].op)) == "aten.log"), None)
        if log is not None:
            break
    if log is None or not log.call:
        return None
    row = TABLE["softplus"]
    Fn = codefix.functional(s.source)
    rw = s.rewrite(lambda src, node: _softplus_text(src, node, Fn), log.call)
    patch = _swap(s, s.rec, log, lambda a, k: F.softplus(a[0]), rw is not None)
    return Diagnosis(
        "softplus", "log(1 + exp(x)) overflowed: it is softplus(x)",
        f"exp(x) overflowed {s.dtype} (x up to {num(s.inp(0).get('max'))}) at {s.where}, and log(1 + Inf) = Inf: "
        f"log(1 + exp(x)) is {Fn}.softplus(x), which never forms exp(x) for large x. A clamp of x would keep "
        "it finite but change its value and cut its gradient for every large x; softplus changes nothing.",
        [Fix(row.kind, "", rewrite=rw, patch=patch, reasoning=row.why,
             guidance=f"replace log(1 + exp(x)) at {_at(log)} by {Fn}.softplus(x) of the same x")])


# ------------------------------------------------------------------ log(1 - exp(x)) -> log(-expm1(x))


def _log1mexp_text(src, node) -> str | None:
    """torch.log1p(-torch.exp(x)) / torch.log(1 - torch.exp(x)) -> torch.log(-torch.expm1(x))."""
    inner = codefix.operand(node, "input")
    x = None
    if _name(node) == "log1p" and isinstance(inner, ast.UnaryOp) and isinstance(inner.op, ast.USub):
        x = _exp_arg(inner.operand)
    elif _name(node) == "log" and isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Sub) \
            and isinstance(inner.left, ast.Constant) and inner.left.value == 1:
        x = _exp_arg(inner.right)
    return f"torch.log(-torch.expm1({src(x)}))" if x is not None else None


@rule("log1mexp", aten.log, aten.log1p, priority=195)
def _log1mexp(s: Site) -> Diagnosis | None:
    if not (s.forward and s.event.kind == "inf" and s.call_is("log", "log1p")):
        return None
    o = s.origin(0)
    pk = packet(str(o.op)) if o is not None else None
    if s.packet == "aten.log1p" and pk == "aten.neg":
        e = s.origin(0, o)
    elif s.packet == "aten.log" and pk in ("aten.rsub", "aten.sub") and len(o.src) == 1:
        e = s.origin(0, o)
    else:
        return None
    if e is None or packet(str(e.op)) != "aten.exp":
        return None
    row = TABLE["log1mexp"]
    rw = s.rewrite(_log1mexp_text)
    patch = _swap(s, e, s.rec, lambda a, k: torch.log(-torch.expm1(a[0])), rw is not None)
    return Diagnosis(
        "log1mexp", "log(1 - exp(x)) with exp(x) rounded to 1",
        f"exp(x) rounded to exactly 1 in {s.dtype} for x just below 0 (|x| under one rounding step, "
        f"{s.finfo.eps:.1e}), so 1 - exp(x) = 0 and its log is -inf at {s.where}; the true value is log(-x), "
        "finite. torch.log(-torch.expm1(x)) computes it to full precision (log1mexp). Where x is itself exactly 0 (a "
        "log-probability of exactly 0: the model is certain), no form of it is finite: then 1 - exp(x) is floored.",
        [Fix(row.kind, "", rewrite=rw, patch=patch, reasoning=row.why,
             guidance=f"replace log(1 - exp(x)) at {s.where} by torch.log(-torch.expm1(x)) of the same x"),
         *_floor_fixes(s)])


def _floor_fixes(s: Site) -> list[Fix]:
    """1 - exp(x) clamped from below at the log (unlikelihood training's `clamp(1 - p, min=...)`): the candidate
    after the exact form, for an x of exactly 0, where log(-expm1(0)) is -inf too."""
    from nanreplay.diagnose.fixes import clamp_eps, edge_fix
    from nanreplay.enums import FixKind

    if s.packet != "aten.log":
        return []
    return edge_fix(s, FixKind.CLAMP, 1.0, "the log and its gradient", clamp_eps, lambda t, e: t.clamp_min(e),
                    lambda e: f"clamp 1 - exp(x) at {e:g} from below")[:2]


# ------------------------------------------------------------------ x * log(y) at 0 -> xlogy / xlog1py


def _from_data(s: Site, i: int, rec: OpRecord | None = None, depth: int = 0) -> bool:
    """The i-th input of `rec` (default: the culprit's op) is computed from batch tensors alone (`-a`, `1 - a`),
    no parameter: no gradient reaches it."""
    leaf = s.leaf(i, rec)
    if leaf is not None:
        return leaf[0] != "parameter"
    o = s.origin(i, rec)
    if o is None or depth > 6 or not o.src:
        return False
    return all(_from_data(s, j, o, depth + 1) for j in range(len(o.src)))


def _xlogy_text(src, node) -> str | None:
    """x * torch.log(y) -> torch.special.xlogy(x, y); x * torch.log1p(y) -> torch.special.xlog1py(x, y)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return None
    for log, other in ((node.left, node.right), (node.right, node.left)):
        if isinstance(log, ast.Call) and _name(log) in ("log", "log1p"):
            y = codefix.operand(log, "input")
            fn = "xlogy" if _name(log) == "log" else "xlog1py"
            return f"torch.special.{fn}({src(other)}, {src(y)})" if y is not None else None
    return None


@rule("xlogy_at_zero", aten.log, aten.log1p, priority=197)
def _xlogy(s: Site) -> Diagnosis | None:
    """c * log(y) where y reaches its edge exactly where c is 0: mathematically 0 there, numerically 0 * -inf."""
    if not (s.forward and s.event.kind == "inf" and s.call_is("log", "log1p")):
        return None
    mul = next((i for i in s.consumers() if packet(str(s.step.ops[i].op)) == "aten.mul"), None)
    if mul is None or not any(e.role == "conversion" and e.fwd == mul for e in s.chain_events()):
        return None
    mrec = s.step.ops[mul]
    if not (mrec.call and s.call) or len(mrec.src) != 2:
        return None
    if not _from_data(s, 0):  # y is data (an action, a target): xlogy's gradient in y is x / y, 0/0 at y = 0
        return None
    row = TABLE["xlogy" if s.packet == "aten.log" else "xlog1py"]
    special = torch.special.xlogy if s.packet == "aten.log" else torch.special.xlog1py
    state: dict = {}

    def grab(func, args, kwargs):
        out = func(*args, **kwargs)
        state["y"], state["log"] = args[0], out
        return out

    def exact(func, args, kwargs):
        other = [a for a in args if not (isinstance(a, torch.Tensor) and a is state.get("log"))]
        if "y" not in state or len(other) != 1:
            return func(*args, **kwargs)
        return special(other[0], state.pop("y"))
    rw = s.rewrite(_xlogy_text, mrec.call)
    each = s.line_calls if rw is not None else (lambda c: [c])
    patch = {**{c: grab for c in each(s.call)}, **{c: exact for c in each(mrec.call)}}
    name = row.exact.split("(")[0]
    return Diagnosis(
        "xlogy_at_zero", f"x * {s.packet.split('.')[1]}(y) at y's edge where x = 0: 0 * -inf",
        f"{s.packet.split('.')[1]}(y) was -inf at {s.where} and the factor it is multiplied by was 0 there, so the "
        f"product is 0 * -inf = NaN; the term is 0 mathematically (a log-density at the edge of its support, e.g. "
        f"a Beta policy at an action of exactly 1). {name} computes it as 0 where x is 0.",
        [Fix(row.kind, "", rewrite=rw, patch=patch, reasoning=row.why,
             guidance=f"compute the product at {_at(mrec)} as {row.exact}")])


# ------------------------------------------------------------------ log(sum(w * exp(a))) -> logsumexp(a + log w)


def _exp_terms(s: Site, rec: OpRecord, depth: int = 0) -> tuple[OpRecord, list[OpRecord]] | None:
    """The exp a product/quotient is made of, and the mul/div ops in between (innermost first)."""
    pk = packet(str(rec.op))
    if pk == "aten.exp":
        return rec, []
    if pk not in ("aten.mul", "aten.div") or depth > 6:
        return None
    for i in range(len(rec.src) if pk == "aten.mul" else 1):  # a quotient: the numerator only
        o = s.origin(i, rec)
        got = _exp_terms(s, o, depth + 1) if o is not None else None
        if got is not None:
            return got[0], got[1] + [rec]
    return None


def _log_of(w) -> torch.Tensor | float:
    return torch.log(w) if isinstance(w, torch.Tensor) else math.log(w)


def _lse_patch(s: Site, e: OpRecord, steps: list[OpRecord], sm: OpRecord, line: bool) -> dict | None:
    """exp -> remember a; each mul/div -> remember ± log of its other operand; sum -> remember dim/keepdim;
    log -> logsumexp(a + Σ ± log w, dim). Computed exactly as the rewritten line shows it."""
    calls = [e.call, sm.call, s.call] + [r.call for r in steps]
    if not all(calls) or len(set(calls)) != len(calls):
        return None
    st: dict = {}

    def grab_exp(func, args, kwargs):
        out = func(*args, **kwargs)
        st.update(a=args[0], cur=out, logw=[], ok=True)
        return out

    def grab_w(div: bool):
        def fn(func, args, kwargs):
            out = func(*args, **kwargs)
            cur = st.get("cur")
            at = next((i for i, x in enumerate(args[:2]) if x is cur), None)
            if at is None or (div and at != 0) or len(args) < 2:
                st["ok"] = False
            else:
                w = args[1 - at]
                st["logw"].append((-1 if div else 1, w))
                st["cur"] = out
            return out
        return fn

    def grab_sum(func, args, kwargs):
        out = func(*args, **kwargs)
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        st.update(dim=dim, keep=keep, ok=st.get("ok", False) and args[0] is st.get("cur"), out=out)
        return out

    def lse(func, args, kwargs):
        if not st.get("ok") or args[0] is not st.get("out"):
            return func(*args, **kwargs)
        z = st["a"]
        for sign, w in st["logw"]:
            z = z + _log_of(w) if sign > 0 else z - _log_of(w)
        dim = st["dim"] if st["dim"] is not None else tuple(range(z.dim()))
        return torch.logsumexp(z, dim, keepdim=bool(st["keep"]))
    each = s.line_calls if line else (lambda c: [c])
    patch = {c: grab_exp for c in each(e.call)}
    for r in steps:
        patch.update({c: grab_w(packet(str(r.op)) == "aten.div") for c in each(r.call)})
    patch.update({c: grab_sum for c in each(sm.call)})
    patch.update({c: lse for c in each(s.call)})
    return patch


def _lse_text(src, node, defs: crossline.Definitions | None = None) -> str | None:
    """torch.log((w * torch.exp(a)).sum(d)) -> torch.logsumexp(a + torch.log(w), d) (numbers: math.log). With
    `defs`, a name the line reads that an earlier line made as such a product (`dens = torch.exp(a) / b`) is
    followed there: that line becomes `log_dens = a - torch.log(b)` (a second edit)."""
    inner = codefix.operand(node, "input")
    if not (isinstance(inner, ast.Call) and _name(inner) == "sum" and _name(node) == "log"):
        return None
    rest = [src(a) for a in codefix.arguments(inner)] + [f"{k.arg}={src(k.value)}" for k in inner.keywords]
    if not rest:
        return None  # a full reduction: logsumexp needs the dims spelled out
    body = _lse_body(codefix.operand(inner, "input"), src, defs)
    return f"torch.logsumexp({body}, {', '.join(rest)})" if body is not None else None


def _lse_body(n, src, defs: crossline.Definitions | None, depth: int = 0) -> str | None:
    """The log of a product/quotient of one exp and weights, as text: exp(a) * w / v -> a + log(w) - log(v)."""
    def log_of(m) -> str:
        number = isinstance(m, ast.Constant) or (isinstance(m, ast.Call) and isinstance(m.func, ast.Attribute)
                                                 and getattr(m.func.value, "id", "") == "math")
        return f"{'math' if number else 'torch'}.log({src(m)})"

    x = _exp_arg(n)
    if x is not None:
        return src(x)
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):
        for a, b in ((n.left, n.right), (n.right, n.left)):
            t = _lse_body(a, src, defs, depth)
            if t is not None:
                return codefix.plus(t, log_of(b))
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
        t = _lse_body(n.left, src, defs, depth)
        return codefix.plus(t, log_of(n.right), "-") if t is not None else None
    if isinstance(n, ast.Name) and defs is not None and depth < 3:
        d = defs.find(n.id)
        t = _lse_body(d.value, d.src, defs, depth + 1) if d is not None else None
        if t is None:
            return None
        new = defs.fresh(f"log_{n.id}")
        defs.replace(d, [f"{new} = {t}"] + ([f"{n.id} = torch.exp({new})"] if d.reused else []))
        return new
    return None


@rule("logsumexp_underflow", aten.log, priority=185)
def _logsumexp_underflow(s: Site) -> Diagnosis | None:
    """log of a sum of (weighted) exps that all underflowed to 0: a mixture density's outlier."""
    if not (s.forward and s.event.kind == "inf" and s.call_is("log") and s.inp(0).get("zeros")):
        return None
    sm = s.origin(0)
    if sm is None or packet(str(sm.op)) != "aten.sum" or not sm.call:
        return None
    got = _exp_terms(s, s.origin(0, sm)) if s.origin(0, sm) is not None else None
    if got is None:
        return None
    e, steps = got
    row = TABLE["logsumexp"]
    defs = crossline.Definitions(s.source, (s.source or {}).get("line"))
    rw = defs.attach(s.rewrite(lambda src, node: _lse_text(src, node, defs)))
    if rw is not None and rw.extra and not crossline.covers(rw, [_line(r) for r in (e, *steps, sm)]):
        rw = None  # the exps and weights it follows are not (all) on the lines it would change
    patch = _lse_patch(s, e, steps, sm, rw is not None)
    weighted = " weighted" if steps else ""
    return Diagnosis(
        "logsumexp_underflow", f"log of a sum of{weighted} exps that all underflowed to 0",
        f"every exp in some row of the sum underflowed to 0 in {s.dtype} (exponents below about "
        f"{math.log(s.finfo.tiny):.0f}; exp at {_at(e)}), so the sum is 0 and log(0) = -inf at {s.where} — "
        "a sample far from every component of a mixture density, say. The exact value is finite: "
        f"{row.exact}. An ε inside the log would keep it finite but cap that sample's loss at -log(ε) and take "
        "away its gradient.",
        [Fix(row.kind, "", rewrite=rw, patch=patch, reasoning=row.why,
             guidance=f"compute the log of the sum at {s.where} as {row.exact}: the exps' exponents a plus the "
                      f"log of their weights (log pi - log sigma for a mixture density), summed over the same dim")])


# ------------------------------------------------------------------ CTC with an infeasible target


def _zero_infinity_text(src, node) -> str | None:
    if not isinstance(node, ast.Call) or any(k.arg == "zero_infinity" for k in node.keywords) or len(node.args) > 6:
        return None
    whole = src(node)
    return whole[:-1].rstrip() + ", zero_infinity=True)" if whole.endswith(")") else None


def _zero_infinity(func, args, kwargs):
    """The call with zero_infinity=True. Called as aten._ctc_loss (a step program records F.ctc_loss as the op its
    composite makes), the flag zeroes only the gradient: the zeroing of the loss is F.ctc_loss's own, done here."""
    low = packet(str(func)) == "aten._ctc_loss"  # (log_probs, targets, lengths, lengths, blank, zero_infinity)
    at = 5 if low else 6  # aten.ctc_loss and F.ctc_loss: a reduction before it
    if len(args) > at:
        args = (*args[:at], True, *args[at + 1:])
        out = func(*args, **kwargs)
    else:
        out = func(*args, **{**kwargs, "zero_infinity": True})
    if low and isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
        out = (torch.where(out[0] == math.inf, torch.zeros_like(out[0]), out[0]), *out[1:])
    return out


@rule("ctc_infeasible", aten._ctc_loss, aten.ctc_loss, priority=25)
def _ctc(s: Site) -> Diagnosis | None:
    # F.ctc_loss runs as aten.ctc_loss, then aten._ctc_loss: a step program records the call as the latter
    if not (s.forward and s.event.kind == "inf" and s.call_is("ctc_loss", "_ctc_loss")):
        return None
    row = TABLE["ctc_infeasible"]
    rw = s.rewrite(_zero_infinity_text)
    if rw is None and s.source and not s.library:  # the call as the user spelled it, not as the program named it
        rw = codefix.rewrite(s.source, s.source["line"], "ctc_loss", _zero_infinity_text)
    lib = f" (inside {s.library}: pass zero_infinity=True to nn.CTCLoss)" if s.library else ""
    return Diagnosis(
        "ctc_infeasible", "CTC loss of a target longer than its input",
        f"ctc_loss returned +inf at {s.where}: for some sample no alignment exists — its target needs more "
        "frames (its length plus one blank between each repeated label) than its input has. The loss of such a "
        "sample is infinite by definition; drop it: zero_infinity=True, or filter those samples out of the batch "
        f"(input_lengths ≥ target_lengths + repeats){lib}.",
        [Fix(row.kind, "", rewrite=rw, patch=s.at_calls(_zero_infinity, rewrite=rw), reasoning=row.why,
             guidance=f"pass zero_infinity=True to ctc_loss at {s.where}, or leave out of the batch the samples "
                      "whose target is longer than their input",
             alternatives=["keep = input_lengths >= target_lengths  # and the repeats: filter such samples out"])])


# ------------------------------------------------------------------ |pred - y| / |y| at y = 0: in the data


@rule("ratio_to_zero_target", aten.div, priority=97)
def _ratio_to_zero_target(s: Site) -> Diagnosis | None:
    """A relative error whose denominator is a batch tensor (through abs) that holds exact zeros."""
    if not (s.forward and s.op_packet == "aten.div" and s.call_is("div", "__truediv__", "true_divide", "divide")):
        return None
    d = s.inp(1)
    if not d.get("zeros"):
        return None
    leaf = s.leaf(1)
    o = s.origin(1)
    if leaf is None and o is not None and packet(str(o.op)) == "aten.abs":
        leaf = s.leaf(0, o)
    if leaf is None or leaf[0] == "parameter" or count_source(s) is not None:
        return None  # a count (num_items_in_batch) of 0 is an empty reduction, not a relative error
    row = TABLE["ratio_to_zero_target"]
    name = leaf[1] if leaf[1].isidentifier() else "y"
    return Diagnosis(
        "ratio_to_zero_target", "a relative error over a zero target",
        f"the denominator is the batch's own {leaf[1]!r}, and it holds {count(d['zeros'], 'exact zero')} at "
        f"{s.where}: a relative error (MAPE) is undefined where the target is 0. The remedy is in the data, not in "
        "the code: leave those rows out of this loss (or use a loss that is defined at 0: MAE, sMAPE). An ε in the "
        "denominator would make the step finite, but the loss of those rows is then |pred| / ε — a number set by "
        "ε, not by the data, so no ε can be verified.",
        [Fix(row.kind, "", reasoning=row.why, verification="not replayed: the remedy is in the data",
             guidance=f"leave out the rows whose target is 0 at {s.where}: keep = {name} != 0, then average the "
                      "relative error over keep only (or report MAE for them)",
             alternatives=[f"denominator.clamp_min(eps): finite, but the loss of a zero-{name} row is then set by eps"])])


# ------------------------------------------------------------------ a softmax over segments (a graph's edges)

_SEGMENT_SUMS = ("aten.index_add", "aten.scatter_add", "aten.scatter_reduce")


def _segment_max(kind: str, base: torch.Tensor, dim: int, index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each segment's maximum of x, put back at every entry of its segment (x's shape): index_add's 1-d index
    along `dim` (index_reduce / index_select), scatter's index of x's shape (scatter_reduce / gather)."""
    lo = torch.full(base.shape, float("-inf"), dtype=x.dtype, device=x.device)
    if kind == "aten.index_add":  # index_add's index names a slice along dim: as a scatter index of x's shape
        shape = [1] * x.dim()
        shape[dim] = -1
        index = index.view(shape).expand_as(x)
    return lo.scatter_reduce(dim, index, x, "amax", include_self=True).gather(dim, index)


def _segment_patch(exps: list[OpRecord], seg: OpRecord, divs: list[OpRecord]) -> dict | None:
    """exp calls -> remember x; the segment sum (index_add / scatter_add / scatter_reduce: (self, dim, index,
    src)) -> m = each segment's max of x, e = exp(x - m[index]), the sum of e; each division -> e over it.
    Replays torch_geometric.utils.softmax's arithmetic."""
    calls = [r.call for r in exps] + [seg.call] + [r.call for r in divs]
    if not all(calls) or len(set(calls)) != len(calls):
        return None
    st: dict = {"outs": []}

    def grab(func, args, kwargs):
        x = args[0]
        st["x"] = x
        out = torch.exp(x - x.detach().amax()) if isinstance(x, torch.Tensor) else func(*args, **kwargs)
        st["outs"].append(out)  # a placeholder (finite): the segment sum replaces it
        return out

    def seg_sum(func, args, kwargs):
        if "x" not in st or len(args) < 4 or not any(args[3] is o for o in st["outs"]):
            return func(*args, **kwargs)
        x, dim, index = st["x"], args[1], args[2]
        st["e"] = torch.exp(x - _segment_max(packet(str(seg.op)), args[0], dim, index, x.detach()))
        return func(args[0], dim, index, st["e"], *args[4:], **kwargs)

    def div(func, args, kwargs):
        if "e" in st and args and any(args[0] is o for o in st["outs"]):
            return func(st["e"], *args[1:], **kwargs)
        return func(*args, **kwargs)
    patch = {r.call: grab for r in exps}
    patch[seg.call] = seg_sum
    patch.update({r.call: div for r in divs})
    return patch


@rule("segment_softmax", aten.exp, priority=62)
def _segment_softmax(s: Site) -> Diagnosis | None:
    """exp(x) / (its sum per segment)[index]: exp overflowed; a max over all of x is not enough."""
    if not (s.forward and s.call_is("exp") and s.event.kind == "inf"):
        return None
    exps = [s.rec]
    if s.rec.src and s.rec.src[0] is not None:
        exps = [r for r in s.step.ops if packet(str(r.op)) == "aten.exp" and r.src[:1] == s.rec.src[:1]]
    cons = [s.step.ops[i] for r in exps for i in s.consumers(s.index(r))]
    seg = next((r for r in cons if packet(str(r.op)) in _SEGMENT_SUMS), None)
    divs = [r for r in cons if packet(str(r.op)) == "aten.div"]
    if seg is None or not divs or len(exps) > 2:
        return None
    row = TABLE["segment_softmax"]
    patch = _segment_patch(exps, seg, divs)
    guide = (f"subtract each segment's own maximum before exp at {s.where} (torch_geometric.utils.softmax does):\n"
             "m = torch.full((num_segments,), float('-inf')).scatter_reduce(0, index, x.detach(), 'amax')\n"
             "e = torch.exp(x - m[index])  # then the same segment sum and division as before\n"
             f"(the segment sum is at {_at(seg)}; a max over dim=-1, all segments at once, lets a segment far "
             "below the global max underflow to 0/0)")
    rw = segfix.exp_edit(s, divs[0].call) if patch is not None and not s.library else None
    return Diagnosis(
        "segment_softmax", "a softmax over segments (a graph's edges) overflowed",
        f"exp overflowed {s.dtype} (inputs up to {num(s.inp(0).get('max'))}) at {s.where}, and the per-segment sum at "
        f"{_at(seg)} and the division made Inf/Inf = NaN. A segment softmax needs the maximum subtracted per "
        "segment, as torch_geometric.utils.softmax does (scatter 'amax'): a single maximum over all entries keeps "
        "exp finite but lets the segments far below it underflow to 0/0.",
        [Fix(row.kind, "", guidance=guide, patch=patch, reasoning=row.why, rewrite=rw, tested_as="op",
             compare_at=sorted(r.call for r in divs) or None)])  # exp(x - m) is not exp(x): compare the quotients
