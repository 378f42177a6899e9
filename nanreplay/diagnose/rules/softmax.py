"""exp overflow, softmax and logsumexp written by hand, and softmax over a fully masked row.
handwritten_softmax outranks the plain exp_overflow: both claim an exp that overflowed."""

from __future__ import annotations

import math
from typing import Any

import torch

from nanreplay.diagnose.edits import codefix, exproot
from nanreplay.diagnose.fixes import finite_mask, operand_fn, replace_arg
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site, library_of, packet
from nanreplay.enums import FixKind
from nanreplay.replay import OpRecord, frame_json
from nanreplay.stats import num

aten = torch.ops.aten


def _sum_dim(s: Site, sum_rec: OpRecord | None) -> tuple[Any, bool, bool]:
    """(dim, keepdim, known) of the user's sum over exp(x), read from their source line."""
    if sum_rec is None or not sum_rec.call:
        return -1, False, False
    fr = frame_json(sum_rec.frame)
    name, at = s.name_of(sum_rec.call), s.ordinal(sum_rec.call)
    dim = codefix.literal_argument(fr, name, "dim", 0, ordinal=at)
    keep = codefix.literal_argument(fr, name, "keepdim", 1, default=False, ordinal=at)
    if isinstance(dim, int) or (isinstance(dim, (tuple, list)) and all(isinstance(d, int) for d in dim)):
        return dim, bool(keep), True
    return -1, False, False


def _logsumexp_text(src, node, dim_text: str) -> str | None:
    """torch.log(torch.exp(x).sum(d)) / torch.log(torch.sum(torch.exp(x), d)) -> torch.logsumexp(x, d)."""
    inner = codefix.operand(node, "input")
    if not isinstance(inner, codefix.ast.Call):
        return None
    e = codefix.operand(inner, "input")
    f = inner.func
    if (f.attr if isinstance(f, codefix.ast.Attribute) else getattr(f, "id", "")) != "sum" or \
            not isinstance(e, codefix.ast.Call):
        return None
    g = e.func
    if (g.attr if isinstance(g, codefix.ast.Attribute) else getattr(g, "id", "")) != "exp":
        return None
    x = codefix.operand(e, "input")
    rest = [src(a) for a in codefix.arguments(inner)] + [f"{k.arg}={src(k.value)}" for k in inner.keywords]
    return f"torch.logsumexp({src(x)}, {', '.join(rest) if rest else dim_text})"


def _exp_operand(node) -> codefix.ast.AST | None:
    """x of torch.exp(x) / x.exp(), else None."""
    return codefix.operand(node, "input") if isinstance(node, codefix.ast.Call) and \
        codefix._callee(node) == "exp" else None


def _softmax_text(src, node, dim, fn: str) -> str | None:
    """torch.exp(x) / torch.exp(x).sum(d, keepdim=True) (or torch.sum(torch.exp(x), d, keepdim=True)) ->
    F.softmax(x, dim=d): the same x on both sides, summed with keepdim (else the division broadcasts otherwise)."""
    ast = codefix.ast
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
        return None
    x, den = _exp_operand(node.left), node.right
    if x is None or not isinstance(den, ast.Call) or codefix._callee(den) != "sum":
        return None
    y = _exp_operand(codefix.operand(den, "input"))
    keep = [k for k in den.keywords if k.arg == "keepdim"]
    if y is None or src(y) != src(x) or not keep or not (isinstance(keep[0].value, ast.Constant)
                                                          and keep[0].value.value is True):
        return None
    return f"{fn}.softmax({src(x)}, dim={dim!r})"


@rule("handwritten_softmax", aten.exp, priority=60)
def _handwritten_softmax(s: Site) -> Diagnosis | None:
    """exp(x) / exp(x).sum() or log(exp(x).sum()) written by hand: exp overflows before the division/log."""
    if not (s.forward and s.call_is("exp") and s.event.kind == "inf"):
        return None
    # exp(x) / exp(x).sum(): every exp of the same x must change together, or the ratio changes
    siblings = [s.rec]
    if s.rec.src and s.rec.src[0] is not None:
        siblings = [r for r in s.step.ops if packet(str(r.op)) == "aten.exp" and r.src[:1] == s.rec.src[:1]]
    cons = [s.step.ops[i] for r in siblings for i in s.consumers(s.index(r))]
    if not any(packet(str(r.op)) in ("aten.sum", "aten.div") for r in cons):
        return None
    sum_rec = next((r for r in cons if packet(str(r.op)) == "aten.sum"), None)
    log_rec = None
    if sum_rec is not None:
        log_rec = next((s.step.ops[j] for j in s.consumers(s.index(sum_rec))
                        if packet(str(s.step.ops[j].op)) == "aten.log"), None)
    dim, keep, known = _sum_dim(s, sum_rec)
    x = s.inp(0)
    lim = math.log(s.finfo.max)
    assumed = "" if known else " (the summed dim could not be read from the source; dim=-1 assumed)"
    compare_at = None
    if log_rec is not None:
        patch = None
        rw = s.rewrite(lambda src, node: _logsumexp_text(src, node, f"dim={dim!r}"), log_rec.call) \
            if log_rec.call else None
        if s.call and log_rec.call and len({s.call, log_rec.call, sum_rec.call}) == 3:
            state: dict = {}

            def grab(func, args, kwargs):
                state["x"] = args[0]
                return func(*args, **kwargs)

            def lse(func, a, k):
                return torch.logsumexp(state["x"], dim, keepdim=keep)
            each = s.line_calls if rw is not None else (lambda c: [c])
            patch = {**{c: grab for c in each(s.call)}, **{c: lse for c in each(log_rec.call)}}
        code = f"replace log(exp(...).sum({dim!r})) by torch.logsumexp(..., dim={dim!r}) of the same argument at {s.where}"
        title, stable = "hand-written logsumexp overflowed", "torch.logsumexp"
        then = "and log(Inf) = Inf"
    else:
        def patch_fn(func, args, kwargs):
            t = args[0]
            return func(t - t.detach().amax(dim=dim, keepdim=True), *args[1:], **kwargs)
        calls = [r.call for r in siblings]
        rw = None
        if len(siblings) == 1:  # one exp call to rewrite on the user's line
            rw = s.rewrite(codefix.with_operand(
                "input", lambda t: codefix.plus(t, f"{codefix.paren(t)}.amax(dim={dim!r}, keepdim=True)", "-")))
        ends = [r.call for r in cons if packet(str(r.op)) == "aten.div" and r.call]
        if rw is None and len(siblings) > 1 and known and len(set(ends)) == 1:
            # exp(x) / exp(x).sum(d, keepdim=True) on one line: the whole division becomes softmax(x, dim=d)
            rw = s.rewrite(lambda src, node: _softmax_text(src, node, dim, codefix.functional(s.source)), ends[0])
        each = s.line_calls if rw is not None else (lambda c: [c])
        patch = {c: patch_fn for r in calls for c in each(r)} if all(calls) and len(set(calls)) == len(calls) else None
        # exp(x - max) is not exp(x): the softmax is the same where the rewritten expression ends, its division
        compare_at = sorted({c for e in ends for c in each(e)}) or None
        code = (f"subtract the maximum over dim {dim!r} from exp's input at {s.where} (or use torch.softmax(..., "
                f"dim={dim!r}), which does)")
        title, stable = "hand-written softmax overflowed", "torch.softmax"
        then = "then the normalisation made Inf/Inf = NaN"
    return Diagnosis("handwritten_softmax", title,
                     f"exp overflowed to Inf for inputs above {lim:.1f} ({s.dtype}; max seen {num(x.get('max'))}) at "
                     f"{s.where}, {then}. Subtracting the maximum over the summed dim first (what torch.softmax and "
                     f"torch.logsumexp do) keeps exp ≤ 1 and changes nothing mathematically.",
                     [Fix(FixKind.MAX_SUBTRACTION, "", rewrite=rw, guidance=code, compare_at=compare_at,
                          patch=patch, reasoning=f"{stable} is the stable form: exp(x - max) never overflows"
                          + assumed)])


@rule("exp_overflow", aten.exp, priority=50)
def _exp_overflow(s: Site) -> Diagnosis | None:
    if not (s.forward and s.call_is("exp") and s.event.kind == "inf"):
        return None
    x = s.inp(0)
    lim = math.floor(math.log(s.finfo.max)) - 1
    # the value is exponentiated elsewhere too (a VAE's logvar: exp(0.5 * logvar) and logvar.exp()): clamp it where it
    # is made, every exp at once, before the clamps of this exp alone. From lim // 2: a value several ops consume is
    # squared somewhere (the gradient norm squares what exp(lim) feeds: 1e37 in float32's norm is inf)
    fixes = exproot.root_clamps(s, list(dict.fromkeys((lim // 2, 20, 10, 5))))
    # exp(87) is finite, but what consumes it may not be (a sum, a square, a product): tighter bounds follow, each
    # verified like the first — and the no-op check rejects a bound that changes exps that were finite
    leaf = s.leaf(0)
    param = leaf[1] if leaf and leaf[0] == "parameter" else None  # a learned log-scale (CLIP's logit_scale)
    for b in dict.fromkeys((lim, lim // 2, 20, 10, 5)):
        rw = s.rewrite(codefix.with_operand("input", lambda t, b=b: f"{codefix.paren(t)}.clamp(max={b})"))
        fn = operand_fn(rw) or (lambda t, b=b: t.clamp(max=b))
        where = f"clamp exp's input to at most {b} at {s.where}"
        if param and rw is None:  # library code: what the user can change is the parameter itself
            where += (f"\nthe input is the learned parameter {param}: keep it at most {b} after every optimizer "
                      f"step, e.g. `with torch.no_grad(): model.{param}.clamp_(max={b})` (CLIP caps its logit "
                      f"scale at ln(100) ≈ 4.6)")
        fixes.append(Fix(FixKind.CLAMP, "", rewrite=rw, guidance=where,
                         patch=s.at_calls(replace_arg(0, fn), rewrite=rw),
                         reasoning=f"exp(x) overflows {s.dtype} above x ≈ {math.log(s.finfo.max):.1f}" + (
                             "" if b == lim else f"; a bound of {b} also keeps what consumes exp (a sum of "
                             f"exps, a square) finite")))
    return Diagnosis("exp_overflow", "exp overflow",
                     f"exp received values up to {num(x.get('max'))} at {s.where}; in {s.dtype} exp overflows above "
                     f"{math.log(s.finfo.max):.1f}. If this is a softmax or logsumexp, use the library function; "
                     "otherwise clamp the input or work in log space.", fixes)


@rule("softmax_all_masked", aten._softmax, aten._log_softmax, priority=40)
def _masked_row(s: Site) -> Diagnosis | None:
    if not (s.forward and s.event.role == "conversion"):
        return None
    lits = [e for e in s.chain_events() if e.role == "literal" and e.index < s.event.index and e.fwd is not None]
    recs = list({id(r): r for r in (s.step.ops[e.fwd] for e in lits) if r.call}.values())
    rws, calls = [], set()
    for r in recs:
        rw = s.rewrite(lambda src, node: _finite_mask_text(src, node, s.dtype), r.call) or \
            _mask_argument_rewrite(s, r.call)  # torch made the -inf from a boolean mask the user's call passed
        calls.update(s.line_calls(r.call) if rw is not None else s.same_site(r.call))  # every layer that makes it
        if rw and all(rw.before != o.before for o in rws):
            rws.append(rw)
    patch = {c: finite_mask for c in sorted(calls)} or None
    rws.sort(key=lambda r: r.line)
    before = "\n".join(r.before for r in rws) or None
    after = "\n".join(r.after for r in rws) or None
    where = ", ".join(sorted({f"{fr['file']}:{fr['line']}" for r in recs if (fr := frame_json(r.frame))})) or s.where
    calls = ", ".join(sorted({s.name_of(r.call) for r in recs if s.name_of(r.call)}))
    inside = f" (the -inf comes from {calls}, called inside torch from {where})" if calls else f" (at {where})"
    code = after or (f"some row has every position masked{inside}: keep at least one allowed position per row "
                     "(e.g. leave sequences that are all padding out of the batch), or mask with "
                     "torch.finfo(dtype).min instead of -inf")
    return Diagnosis("softmax_all_masked", "softmax over a fully masked row",
                     f"every entry of some softmax row was -inf (a mask with no allowed position, e.g. an all-padding "
                     f"sequence), so softmax computed exp(-inf - (-inf)) = NaN at {s.where}. A healthy causal mask is "
                     "fine; an empty row is not. Use the dtype's most negative finite value as the mask value "
                     "(the row then becomes uniform, and you can zero it), or drop empty rows.",
                     [Fix(FixKind.FINITE_MASK_VALUE, after or "", before=before, after=after, patch=patch,
                          guidance=None if after else code,
                          reasoning="finfo(dtype).min behaves like -inf for every row that has an allowed position, "
                                    "and keeps fully masked rows finite")])


def _is_neg_inf(node) -> bool:
    """float('-inf'), -float('inf'), -math.inf, -torch.inf, -np.inf as written in source."""
    ast = codefix.ast
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = node.operand
        if isinstance(v, ast.Attribute) and v.attr == "inf":
            return True
        return isinstance(v, ast.Call) and getattr(v.func, "id", "") == "float" and len(v.args) == 1 and \
            isinstance(v.args[0], ast.Constant) and str(v.args[0].value).lower() in ("inf", "infinity")
    return isinstance(node, ast.Call) and getattr(node.func, "id", "") == "float" and len(node.args) == 1 and \
        isinstance(node.args[0], ast.Constant) and str(node.args[0].value).lower() in ("-inf", "-infinity")


def _finite_mask_text(src, node, dtype: str, is_inf=_is_neg_inf) -> str | None:
    """s.masked_fill(m, float('-inf')) -> s.masked_fill(m, torch.finfo(s.dtype).min); the same for where().
    `is_inf`: which literal is the mask value (a +inf one for a mask written with the wrong sign)."""
    ast = codefix.ast
    if not isinstance(node, ast.Call):
        return None
    values = list(node.args) + [k.value for k in node.keywords]
    lit = next((v for v in values if is_inf(v)), None)
    if lit is None:
        return None
    if not codefix._is_function_call(node):
        ref = node.func.value  # s.masked_fill(...)
    else:
        ref = next((a for a in node.args[1:] if a is not lit), None) if getattr(node.func, "attr", "") == "where" \
            else (node.args[0] if node.args else None)
    if isinstance(ref, (ast.Name, ast.Attribute)):
        value = f"torch.finfo({src(ref)}.dtype).min"
    else:
        value = f"torch.finfo(torch.{dtype}).min"
    whole = src(node)
    a = lit.col_offset - node.col_offset if lit.lineno == node.lineno else None
    if a is None or whole[a:a + len(src(lit))] != src(lit):
        return None
    return whole[:a] + value + whole[a + len(src(lit)):]


_MASK_KWARGS = ("key_padding_mask", "src_key_padding_mask", "tgt_key_padding_mask", "memory_key_padding_mask",
                "attn_mask", "src_mask", "tgt_mask", "memory_mask")


def _float_mask_text(src, node, dtype: str) -> str | None:
    """attn(q, k, v, key_padding_mask=pad) -> the same call with pad passed as a float mask that holds
    finfo(dtype).min where pad is True. torch turns a boolean mask into -inf itself (nn.MultiheadAttention,
    nn.Transformer*), inside its own code: the line the user can edit is the call that passes the mask.
    scaled_dot_product_attention reads a boolean mask the other way round (True: attend)."""
    ast = codefix.ast
    if not isinstance(node, ast.Call):
        return None
    kw = next((k for k in node.keywords if k.arg in _MASK_KWARGS), None)
    if kw is None or not isinstance(kw.value, (ast.Name, ast.Attribute, ast.Subscript)):
        return None
    m = src(kw.value)
    q = node.args[0] if node.args else None
    ref = f"{src(q)}.dtype" if isinstance(q, (ast.Name, ast.Attribute)) else f"torch.{dtype}"
    fill = f"~{codefix.paren(m)}" if (codefix._callee(node) or "").endswith("scaled_dot_product_attention") else m
    value = f"torch.zeros_like({m}, dtype={ref}).masked_fill({fill}, torch.finfo({ref}).min)"
    whole = src(node)
    a, b = kw.value.col_offset - node.col_offset, kw.value.end_col_offset - node.col_offset
    if kw.value.lineno != node.lineno or kw.value.end_lineno != node.lineno or whole[a:b] != m:
        return None
    return whole[:a] + value + whole[b:]


def _mask_argument_rewrite(s: Site, call: int) -> codefix.Rewrite | None:
    """The user's line that called into torch with a boolean mask (`self.attn(h, h, h, key_padding_mask=pad)`),
    rewritten to pass it as a finite float mask: the one call on that line with such a keyword."""
    src = s.source_of(call)
    if not src or library_of(src.get("recorded_path") or src.get("file") or ""):
        return None
    got = codefix.source_lines(src)
    parsed = codefix._parse(got[0], got[1], src["line"], whole=not src.get("context")) if got else None
    if parsed is None:
        return None
    rel = parsed.rel(src["line"])
    nodes = [n for n in codefix.ast.walk(parsed.tree) if isinstance(n, codefix.ast.Call) and n.lineno == rel
             and any(k.arg in _MASK_KWARGS for k in n.keywords)]
    if len(nodes) != 1:
        return None
    new = _float_mask_text(codefix.source_of_nodes(parsed), nodes[0], s.dtype)
    return codefix.splice(src, codefix.Located(nodes[0], parsed), [(nodes[0], new)], src["line"]) if new else None
