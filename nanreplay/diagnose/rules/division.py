"""Division and reductions that divide: a zero denominator, a zero norm or standard deviation,
an unbiased std over one element, a mean over nothing. normalize_zero_norm outranks the plain
division_by_zero: both claim x / 0, and naming the norm explains it better."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch

from nanreplay import stats  # stats.num: `num` is a local name (the numerator) in several rules here
from nanreplay.diagnose.edits import codefix, datafix, posfix
from nanreplay.diagnose.fixes import (
    choose_eps,
    clamp_eps,
    edge_fix,
    fmt,
    operand_fn,
    plus_eps,
    replace_arg,
    root_fix_parts,
    shared_root,
    uses_where,
)
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.prose import count, count_in
from nanreplay.diagnose.site import Site, finite_float, packet
from nanreplay.enums import FixKind

aten = torch.ops.aten


def _std_args(args: tuple, kwargs: dict) -> tuple[Any, Any, bool]:
    """(input, dim, keepdim) of a std/var call, whichever overload the user spelled:
    std(x, dim=None, *, correction, keepdim), std(x, dim, unbiased, keepdim), std(x, unbiased)."""
    x, rest = args[0], list(args[1:])
    dim, keepdim = kwargs.get("dim"), kwargs.get("keepdim", False)
    if rest and isinstance(rest[0], bool):
        rest = []  # std(x, unbiased): a full reduction
    elif rest:
        dim = rest[0]
        if len(rest) > 2:
            keepdim = rest[2]
    return x, dim, keepdim


def _group_size(x, dim) -> int:
    if dim is None:
        return x.numel()
    dims = [dim] if isinstance(dim, int) else list(dim)
    return math.prod(x.shape[d] for d in dims)


def _population(eps: float | None) -> Callable:
    """std/var(..., correction=min(1, n - 1)) at this call — Bessel's correction kept wherever a group has more than
    one element, so every healthy value is unchanged — then (for a denominator) .clamp_min(eps)."""
    def fn(func, args, kwargs):
        x, dim, keepdim = _std_args(args, kwargs)
        c = min(1, _group_size(x, dim) - 1)
        out = func(x, dim, correction=c, keepdim=keepdim) if dim is not None else func(x, correction=c, keepdim=keepdim)
        return out if eps is None else out.clamp_min(eps)
    return fn


def _correction_text(src, node, rest) -> str:
    """The user's spelling of min(1, n - 1) for this call: n is x.numel() for a full reduction, the product of
    x.shape[d] over literal dims (a 0 where neither can be written)."""
    x = src(node.args[0]) if codefix._is_function_call(node) and node.args else \
        src(node.func.value) if isinstance(node.func, codefix.ast.Attribute) else None
    dim = rest[0] if rest else next((k.value for k in node.keywords if k.arg == "dim"), None)
    if x is None:
        return "0"
    if dim is None:
        return f"min(1, {x}.numel() - 1)"
    dims = dim.elts if isinstance(dim, (codefix.ast.Tuple, codefix.ast.List)) else [dim]
    if dims and all(isinstance(d, codefix.ast.Constant) and isinstance(d.value, int) and not isinstance(d.value, bool)
                    for d in dims):
        return f"min(1, {' * '.join(f'{x}.shape[{d.value}]' for d in dims)} - 1)"
    return "0"


def _population_text(src, node, eps: float | None) -> str | None:
    """x.std(0) -> x.std(0, correction=0): drop `unbiased`, keep dim and keepdim as written."""
    if not isinstance(node, codefix.ast.Call):
        return None
    rest = codefix.arguments(node)
    if rest and isinstance(rest[0], codefix.ast.Constant) and isinstance(rest[0].value, bool):
        rest = []
    parts = [src(rest[0])] if rest else []
    if len(rest) > 2:
        parts.append(f"keepdim={src(rest[2])}")
    parts += [f"{k.arg}={src(k.value)}" for k in node.keywords if k.arg not in ("unbiased", "correction")]
    parts.append(f"correction={_correction_text(src, node, rest)}")
    head = src(node.func)
    if codefix._is_function_call(node):
        parts.insert(0, src(node.args[0]))
    text = f"{head}({', '.join(parts)})"
    return text if eps is None else f"{text}.clamp_min({fmt(eps)})"


@rule("std_single_element", aten.std, aten.var, priority=100)
def _std_one(s: Site) -> Diagnosis | None:
    """Unbiased std/var (divide by n - 1) over one element: 0/0 = NaN."""
    if not (s.forward and s.call_is("std", "var") and s.event.kind == "nan"):
        return None
    x = s.inp(0)
    n_out = s.event.out.get("numel", 0)
    if not x.get("shape") or not n_out or math.prod(x["shape"]) // n_out > 1:
        return None  # more than one element per group: not this cause
    name = s.call_name.rsplit(".", 1)[-1]
    eps, why = choose_eps(s.dtype, x.get("absmax"), f"x / {name}.clamp_min(eps) and its gradient")
    denominator = any(packet(str(s.step.ops[i].op)) == "aten.div" and len(s.step.ops[i].src) > 1
                      and s.step.ops[i].src[1] == s.event.fwd for i in s.consumers())
    fixes = []
    for e in (None, eps) if denominator else (None,):
        rw = s.rewrite(lambda src, node, e=e: _population_text(src, node, e))
        guide = (f"pass correction=min(1, n - 1) to {name}() at {s.where} (n: the elements it reduces; Bessel's "
                 "correction stays wherever there is more than one)" + (f", then clamp it to at least {fmt(e)}" if e
                                                                        else ""))
        fixes.append(Fix(FixKind.CORRECTION, "", epsilon=e, rewrite=rw, guidance=guide,
                         patch=s.at_calls(_population(e), rewrite=rw),
                         reasoning=f"with one element the correction is 0 (the population {name}: 0, not NaN); with "
                                   f"more it stays 1, so every healthy value is unchanged"
                                   + (f"; it is then a zero denominator, hence clamp_min — {why}" if e else "")))
    return Diagnosis("std_single_element", f"unbiased {name} over a single element",
                     f"{s.call_name}() uses Bessel's correction (divide by n - 1); over one element that is 0/0 = NaN "
                     f"({s.where}). A batch or group of size 1 does this: drop the correction for a group of one only "
                     f"(correction=min(1, n - 1)), or skip groups of one"
                     + (f", and since the {name} is then 0, keep it away from 0 where it divides." if denominator
                        else "."), fixes)


def _floor_clamped(num: dict, fi: torch.finfo) -> float | None:
    """x / y.clamp_min(eps): where it clamps no gradient reaches y, so only x / eps must stay finite."""
    n = finite_float(num.get("absmax"))
    return n / fi.max if n else None


@rule("empty_reduction", aten.nll_loss_forward, aten.nll_loss2d_forward, aten.mean, aten.div, priority=90)
def _empty_reduction(s: Site) -> Diagnosis | None:
    if s.op_packet == "aten.div":
        return _count_rule(s)
    if not s.forward or s.event.kind != "nan" or s.event.role != "origin":
        return None
    if s.packet == "aten.mean":
        x = s.inp(0)
        if x.get("shape") is None or math.prod(x["shape"]) != 0 or not s.call_is("mean"):
            return None

        def guarded_mean(func, args, kwargs):
            t = args[0]
            if len(args) > 1 or "dim" in kwargs:
                return torch.nan_to_num(func(*args, **kwargs) * 0.0) if t.numel() == 0 else func(*args, **kwargs)
            return t.sum() / max(t.numel(), 1)
        rw = s.rewrite(lambda src, node: _guarded_mean_text(src, node))
        fix = Fix(FixKind.GUARD_EMPTY_REDUCTION, "", rewrite=rw,
                  guidance=f"divide the sum by max(number of elements, 1) instead of taking mean() at {s.where}: "
                           "the mean of an empty tensor is NaN",
                  patch=s.at_calls(guarded_mean, rewrite=rw),
                  reasoning="an empty selection contributes 0 instead of 0/0 (or skip the term when it is empty)")
        return Diagnosis("empty_reduction", "mean over zero elements",
                         f"mean() of an empty tensor (shape {x['shape']}) is 0/0 = NaN ({s.where}): a mask or filter "
                         "selected nothing in this batch.", [fix])
    target = next((st for st in s.inputs if st.get("dtype", "").startswith("int")), None)
    if target is None:
        return None
    ints = [v for v in (s.event.scalars or []) if isinstance(v, int) and not isinstance(v, bool)]
    ignore = ints[-1] if ints else -100  # nll_loss_forward(input, target, weight, reduction, ignore_index)

    def guarded(func, args, kwargs):
        """reduction='mean' is sum / (sum of the counted targets' weights): the same, but never 0/0."""
        if len(args) >= 5 and isinstance(args[3], int):  # the aten op a step program runs: nll_loss_forward(input,
            if args[3] != 1:                              # target, weight, reduction, ignore_index) -> (loss, weight)
                return func(*args, **kwargs)
            out, total = func(*args[:3], 2, *args[4:], **kwargs)  # 2: reduction='sum'; total: the counted weight
            return out / torch.where(total > 0, total, torch.ones_like(total)), total
        tgt = args[1] if len(args) > 1 else kwargs["target"]
        ii = kwargs.get("ignore_index", -100)
        w = kwargs.get("weight", args[2] if len(args) > 2 else None)
        valid = tgt != ii
        n = valid.sum() if w is None else w[tgt.masked_fill(~valid, 0)].masked_fill(~valid, 0).sum()
        kw = {**kwargs, "reduction": "sum"}
        return func(*args, **kw) / torch.where(n > 0, n, torch.ones_like(n))
    rw = s.rewrite(lambda src, node: _guarded_ce_text(src, node, ignore))
    guide = (f"compute the loss with reduction='sum' and divide by the number of targets that are not {ignore} "
             "(at least 1), so a batch whose targets are all ignored gives 0")
    if rw is None:  # no line of the user's to change (a library's loss, transformers' own): what the user can do
        guide += (f"; where the loss is a library's, skip (or repair) batches whose targets are all {ignore} before "
                  "the model call — e.g. a prompt truncated past its answer")
    fix = Fix(FixKind.GUARD_EMPTY_REDUCTION, "", rewrite=rw, guidance=guide,
              patch=s.at_calls(guarded, rewrite=rw) if s.call_is("cross_entropy", "nll_loss", "nll_loss_forward") else None,
              reasoning="the same mean over the targets that count, but a batch whose targets are all ignored "
                        "contributes 0 instead of 0/0")
    return Diagnosis("empty_reduction", "cross-entropy mean over zero targets (all ignore_index)",
                     f"all {math.prod(target.get('shape') or [0])} targets in the batch equal ignore_index ({ignore}), so "
                     f"reduction='mean' divides 0 by 0 ({s.where}). Common with padding-only or fully masked batches.",
                     [fix])


def _guarded_mean_text(src, node) -> str | None:
    """x[m].mean() / torch.mean(x[m]) -> x[m].sum() / max(x[m].numel(), 1) (full reductions only)."""
    if not isinstance(node, codefix.ast.Call) or codefix.arguments(node) or node.keywords:
        return None
    t = codefix.paren(src(codefix.operand(node, "input")))
    return f"{t}.sum() / max({t}.numel(), 1)"


def _guarded_ce_text(src, node, ignore: int) -> str | None:
    """F.cross_entropy(z, y, ...) -> F.cross_entropy(z, y, ..., reduction='sum') / (y != ii).sum().clamp_min(1)."""
    if not isinstance(node, codefix.ast.Call) or not codefix._is_function_call(node):
        return None
    target = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "target"), None)
    if target is None or any(k.arg in ("reduction", "weight", "label_smoothing") for k in node.keywords) \
            or len(node.args) > 2:
        return None
    parts = [src(a) for a in node.args] + [f"{k.arg}={src(k.value)}" for k in node.keywords] + ["reduction='sum'"]
    named = next((src(k.value) for k in node.keywords if k.arg == "ignore_index"), None)  # as the user spelled it
    return f"{src(node.func)}({', '.join(parts)}) / ({src(target)} != {named or ignore}).sum().clamp_min(1)"


_NORMS = ("aten.linalg_vector_norm", "aten.norm", "aten.sqrt", "aten.std", "aten.var", "aten.abs")
_NONNEG = ("aten.abs", "aten.pow", "aten.square", "aten.relu", "aten.exp", "aten.sigmoid", "aten.softmax",
           "aten._softmax")  # a sum of these is a norm (an L1 norm, a normaliser): a count is not
_DIVS = ("div", "__truediv__", "true_divide", "divide")


_MASKS = ("aten.eq", "aten.ne", "aten.gt", "aten.lt", "aten.ge", "aten.le", "aten.logical_not", "aten.logical_and",
          "aten.logical_or", "aten.bitwise_not", "aten.bitwise_and", "aten.bitwise_or")


# a mask the code builds by filling, then writing into: `keep = torch.ones(n); keep[pad] = 0`
_FILLED_MASKS = ("aten.ones", "aten.zeros", "aten.ones_like", "aten.zeros_like", "aten.new_ones", "aten.new_zeros")
_MASK_WRITES = ("aten.index_put", "aten.masked_fill", "aten.index_fill", "aten.fill")


def _is_mask(s: Site, rec, i: int, depth: int = 0) -> bool:
    """The i-th input of `rec` is a mask: a comparison (cast or not), a tensor of the batch (a leaf), or a tensor
    filled with ones or zeros (written into where positions are dropped: the write's own record, or the filled
    one where a view took it)."""
    if s.src(i, rec) is None or s.origin_packet(i, rec) in _MASKS + _FILLED_MASKS:
        return True
    r = s.origin(i, rec)
    return depth < 4 and r is not None and packet(str(r.op)) in _MASK_WRITES and _is_mask(s, r, 0, depth + 1) \
        and s.src(0, r) is not None  # the written tensor is made here, not a batch tensor changed in place


_COUNT_NAMES = ("num_items", "num_tokens", "n_tokens", "ntokens", "num_pos", "n_pos", "count", "num_valid",
                "n_valid", "num_elements", "numel", "denom")


def _batch_tensor(s: Site, name: str) -> torch.Tensor | None:
    from nanreplay.replay.subject import batch_tensors
    try:
        return next((t for n, _, t in batch_tensors(s.subject) if n == name), None)
    except Exception:  # noqa: BLE001 - a subject without a batch to look at: no evidence
        return None


def _is_01(s: Site, rec, i: int, depth: int = 0) -> bool:
    """The i-th input of `rec` holds only 0s and 1s by provenance: a comparison (cast or not), a product of
    such, a bool/integer batch tensor or a batch tensor of 0s and 1s (an attention mask)."""
    if depth > 8:
        return False
    leaf = s.leaf(i, rec)
    if leaf is not None:
        t = _batch_tensor(s, leaf[1])
        return t is not None and (not t.is_floating_point() or bool(((t == 0) | (t == 1)).all()))
    r = s.origin(i, rec)
    if r is None:
        return False
    pk = packet(str(r.op))
    if pk in _MASKS:
        return True
    if pk in ("aten.mul", "aten.logical_and", "aten.bitwise_and"):
        tensors = [j for j in range(len(r.src)) if r.src[j] is not None or (r.leaves and r.leaves[j])]
        return bool(tensors) and all(_is_01(s, r, j, depth + 1) for j in tensors)
    return False


def count_source(s: Site, i: int = 1) -> str | None:
    """In words, why the culprit's i-th input is a count (of tokens, items, positives), or None: an integer
    tensor, a batch entry named as a count (num_items_in_batch), or a sum / count_nonzero of a 0/1 tensor —
    however many products and casts lie in between."""
    st = s.inp(i)
    leaf = s.leaf(i)
    if leaf is not None:
        low = leaf[1].lower()
        if any(k in low for k in _COUNT_NAMES):
            return f"the batch entry {leaf[1]!r}"
        t = _batch_tensor(s, leaf[1])
        if t is not None and not t.is_floating_point():
            return f"the integer batch entry {leaf[1]!r}"
    if st.get("dtype", "").startswith(("int", "uint", "bool")):
        return "an integer tensor"
    r = s.origin(i)
    if r is None:
        return None
    pk = packet(str(r.op))
    if pk == "aten.count_nonzero":
        return "a count_nonzero()"
    if pk == "aten.sum" and _is_01(s, r, 0):
        return "a sum of a 0/1 mask (a count of selected positions)"
    return None


def _count_rule(s: Site) -> Diagnosis | None:
    """x / n where n is a count that is 0 in this batch: a reduction over nothing (a mean over zero tokens,
    transformers' `loss / num_items_in_batch` with every label -100, a focal loss `/ num_pos` with no positives)."""
    if not (s.forward and s.op_packet == "aten.div" and s.call_is(*_DIVS)):
        return None
    d = s.inp(1)
    what = count_source(s) if d.get("zeros") else None
    if what is None:
        return None
    leaf = s.leaf(1)
    words = re.findall(r"[A-Za-z_]\w*", leaf[1]) if leaf is not None else []
    name = words[-1] if words else "count"
    rw = None if s.library else s.rewrite(codefix.with_operand("other", lambda t: f"{codefix.paren(t)}.clamp_min(1)"))
    fn = operand_fn(rw) or (lambda t: t.clamp_min(1))
    fix = Fix(FixKind.GUARD_EMPTY_REDUCTION, "", rewrite=rw, patch=s.at_calls(replace_arg(1, fn), rewrite=rw),
              guidance=(f"pass {name}.clamp_min(1) where you call {s.library} (the division by it is {s.library}'s "
                        f"own code, {s.made_where}: not yours to edit), or skip batches with nothing to average"
                        if s.library else f"divide by the count clamped to at least 1 ({name}.clamp_min(1)) at "
                        f"{s.where}: a batch with nothing to average then contributes 0"),
              reasoning="a count is a whole number: clamp_min(1) changes nothing where it is ≥ 1, and where it is 0 "
                        "the sum it divides is 0 too, so the term becomes 0 instead of 0/0")
    zero = "0/0 = NaN" if s.event.kind == "nan" else "x/0 = Inf"
    shared = None if s.library else _root_count_fix(s, fix.reasoning)
    return Diagnosis("empty_reduction", "a reduction over zero elements (a count of 0)",
                     f"the denominator is a count — {what} — and it is 0 in this batch "
                     f"({count(d['zeros'], 'zero count')}), so the division at {s.where} is {zero}: the batch has "
                     "nothing to average (every label ignored, e.g. -100 everywhere because a prompt was truncated "
                     "past its answer; a mask that selects no token; no positive examples). Keep the count at "
                     "least 1, and skip or repair batches with nothing to average in the data pipeline."
                     + (shared[1] if shared else ""), ([shared[0]] if shared else []) + [fix])


@rule("masked_mean_empty", aten.div, priority=95)
def _masked_mean(s: Site) -> Diagnosis | None:
    """(x * mask).sum() / mask.sum() with a mask that selects nothing: 0/0. Not a norm: a count of zero."""
    if not (s.forward and s.op_packet == "aten.div" and s.call_is(*_DIVS) and s.event.kind == "nan"):
        return None
    d = s.inp(1)
    den, num = s.origin(1), s.origin(0)
    if not d.get("zeros") or den is None or num is None or packet(str(den.op)) != "aten.sum" \
            or packet(str(num.op)) != "aten.sum" or not _is_mask(s, den, 0):
        return None
    prod = s.origin(0, num)
    if prod is None or packet(str(prod.op)) != "aten.mul":
        return None
    mask = s.src(0, den)
    if not any(s.src(i, prod) is mask or (mask is None and s.src(i, prod) is None) for i in range(len(prod.src))):
        return None  # the product is not weighted by the mask that is counted
    why = ("a masked mean over a mask with no selected position has no value; clamping the count to 1 "
           "makes it 0 there (the sum is 0) and changes nothing where the mask selects something")
    fixes, shared = [], _root_count_fix(s, why)
    if shared is not None:
        fixes.append(shared[0])
    rw = s.rewrite(codefix.with_operand("other", lambda t: f"{codefix.paren(t)}.clamp_min(1)"))
    fn = operand_fn(rw) or (lambda t: t.clamp_min(1))
    fixes.append(Fix(FixKind.GUARD_EMPTY_REDUCTION, "", rewrite=rw, patch=s.at_calls(replace_arg(1, fn), rewrite=rw),
                     guidance=f"divide by the mask's count clamped to at least 1 at {s.where}: an empty mask then "
                              "gives 0", reasoning=why))
    return Diagnosis("masked_mean_empty", "masked mean over zero selected positions",
                     f"a masked mean, (x * mask).sum() / mask.sum(), divided 0 by 0 at {s.where}: the mask selects "
                     f"nothing in this batch ({count(d['zeros'], 'zero count')}; e.g. a sequence that is all "
                     "padding). The sum is not a norm, it counts positions: keep the count at least 1, or skip the "
                     "term when the mask is empty." + (shared[1] if shared else ""), fixes)


def _root_count_fix(s: Site, why: str) -> tuple[Fix, str] | None:
    """Where the zero count is shared (an auxiliary loss divides two sums by it, on consecutive lines), the count
    clamped where it is made: one change that fixes every division by it (a patch of one quotient leaves the
    other NaN). With the sentence that says so."""
    got = shared_root(s, 1)
    if got is None:
        return None
    root, uses = got
    rw, patch = root_fix_parts(s, root, lambda t: f"{codefix.paren(t)}.clamp_min(1)", lambda t: t.clamp_min(1))
    made = _made_at(root)
    # the count itself changes (0 -> 1) by design: the no-op check compares where it is used, the quotients
    calls = {c for i in uses if s.step.ops[i].call for c in (s.line_calls(s.step.ops[i].call) if rw else
                                                              [s.step.ops[i].call])}
    fix = Fix(FixKind.GUARD_EMPTY_REDUCTION, "", rewrite=rw, patch=patch, reasoning=why, compare_at=sorted(calls) or None,
              guidance=f"clamp the count to at least 1 where it is made ({made}): every division by it "
                       f"({uses_where(s, uses)}) then gives 0 for an empty batch")
    return fix, (f" The same count is used at {len(uses)} places ({uses_where(s, uses)}): fix it where it is made, "
                 f"{made}, so every use is fixed.")


def _made_at(rec) -> str:
    from nanreplay.replay import frame_json
    fr = frame_json(rec.frame)
    return f"{fr['file']}:{fr['line']}" if fr else "where it is computed"


@rule("normalize_zero_norm", aten.div, priority=80)
def _normalize(s: Site) -> Diagnosis | None:
    if not (s.forward and s.op_packet == "aten.div" and s.call_is(*_DIVS)):
        return None
    idx = 1
    d = s.inp(idx)
    prod = s.origin_packet(idx)
    if prod == "aten.sum" and s.origin_packet(0, s.origin(idx)) in _NONNEG:
        prod = "aten.abs"  # x / |x|.sum(): an L1 norm
    if not d.get("zeros") or prod not in _NORMS or s.event.kind != "nan":
        return None
    is_std = prod in ("aten.std", "aten.var", "aten.sqrt")
    label = "standard deviation" if is_std else "norm"
    num = s.inp(0)
    fixes = edge_fix(s, FixKind.EPSILON, num.get("absmax"), f"x / {label}.clamp_min(eps) and its gradient",
                     clamp_eps, lambda t, e: t.clamp_min(e),
                     lambda e: f"clamp the {label} you divide by to at least {fmt(e)} (F.normalize(..., eps={fmt(e)}) "
                               "does this for a norm)",
                     which="other", arg=idx, floor=_floor_clamped(num, s.finfo), floor_why="the quotient x / eps",
                     data_eps=d.get("absmin_nonzero"), root=True)
    what = ("(x - mean) / std with a constant feature or group (std = 0 and x - mean = 0)" if is_std
            else "x / x.norm() with an all-zero vector (norm = 0)")
    rows = _data_rows(s, idx, label) if not is_std else None
    if rows is not None:
        fixes.append(rows)
    return Diagnosis("normalize_zero_norm", f"division by a zero {label}",
                     f"{what}: {count_in(d['zeros'], 'zero denominator', d)} at {s.where}, giving 0/0 = NaN."
                     + (f" {rows.reasoning}" if rows is not None else ""), fixes)


def _data_rows(s: Site, idx: int, label: str) -> Fix | None:
    """Where the zero norm is the norm of a batch tensor (an all-zero reference clip), the quantity the line
    computes (a projection on it, SI-SDR) is undefined for that row: no ε gives it a value, since whatever
    follows (log10 of a zero target energy) stays infinite. Offered after the ε candidates: it is shown when none
    of them verifies. Not replayed: the remedy is in the data (filter those rows out of the batch)."""
    rec, leaf = s.rec, None
    i = idx
    for _ in range(4):  # the norm's input, through sum / pow / abs / mul, back to a batch tensor
        leaf = s.leaf(i, rec)
        if leaf is not None:
            break
        o = s.origin(i, rec)
        if o is None or packet(str(o.op)) not in ("aten.sum", "aten.pow", "aten.abs", "aten.square", "aten.mul",
                                                  "aten.linalg_vector_norm", "aten.norm", "aten.sqrt"):
            return None
        rec, i = o, 0
    if leaf is None or leaf[0] == "parameter":
        return None
    name = leaf[1]  # as the batch spells it ('batch[0]', 'target'): a position is not a role
    den = None
    loc = codefix.locate(s.source, (s.source or {}).get("line"), s.spelled(s.call), ordinal=s.ordinal(s.call))
    if loc is not None:
        node = codefix.operand(loc.node, "other")
        den = codefix.source_of_nodes(loc.parsed)(node) if node is not None else None
    raw = den
    rows_at = _zero_rows(s, leaf)
    den = re.sub(r",\s*keepdim\s*=\s*True", "", den) if den else None  # one flag per row
    keep = f"{den} > 0" if den else f"{name}'s {label} > 0"
    rw = _row_filter(s, idx, den, label, kept_dims=bool(raw) and raw != den, rows_at=rows_at) if den else None
    return Fix(FixKind.MASK_ROWS, "", verification="not replayed: the remedy is in the data", rewrite=rw,
               reasoning=(f"The {label} is that of the batch's own {name!r}: for a row where it is all zeros (a silent "
                          "reference clip, an empty sample) the quantity is undefined, and an ε only sets a value for "
                          "it (a projection on a zero vector is 0; the log of a zero energy that follows stays "
                          "infinite). Where such rows are not meant to be there, the remedy is in the data: leave "
                          "them out of the batch, or out of this loss, before it is computed."
                          + (f" The all-zero rows of {leaf[1]!r} in this batch: {rows_at}." if rows_at else "")),
               guidance=(f"the remedy is in the data: leave out of this loss the rows where {keep} is false, before "
                         f"it is computed at {s.where} (keep = {keep}; index every per-row tensor of the loss with "
                         "keep), or drop such samples from the dataset; masking the loss after it is computed "
                         "is not enough: the NaN of a masked row still reaches the gradient (0 * NaN)"),
               alternatives=[f"{label}.clamp_min(eps): finite here, but the row's loss is then set by eps (or the "
                             "next op is infinite)"])


def _zero_rows(s: Site, leaf: tuple[str, str]) -> list[int]:
    """The rows (dim 0) of the batch tensor `leaf` that are all zeros: the samples to find in the data."""
    from nanreplay.replay.subject import batch_tensors
    t = next((t for n, role, t in batch_tensors(s.subject) if n == leaf[1]), None)
    if t is None or t.dim() == 0 or not t.is_floating_point():
        return []
    return (t.reshape(t.shape[0], -1) == 0).all(1).nonzero().flatten()[:20].tolist()


def _row_filter(s: Site, idx: int, den: str, label: str, kept_dims: bool, rows_at: list[int]):
    """The culprit's statement with the zero-norm rows filtered out above it (datafix.py), where the denominator
    is one value per row and every tensor the division reads has those rows first; else None (guidance only)."""
    d, num = s.inp(idx), s.inp(1 - idx)
    shape, nshape = d.get("shape") or [], num.get("shape") or []
    if not shape or any(n != 1 for n in shape[1:]) or not nshape or nshape[0] != shape[0] or shape[0] < 2:
        return None
    got = datafix.statement_at(s.source, (s.source or {}).get("line"))
    if got is None:
        return None
    names = datafix.rows_read_from(s.source, s.source["line"])
    if not names:
        return None
    keep = datafix.keep_name(set(re.findall(r"[A-Za-z_]\w*", "\n".join(codefix.source_lines(s.source)[1]))))
    expr = f"{den} > 0" if kept_dims or len(shape) == 1 else f"({den} > 0).flatten(1).all(1)"
    lines = datafix.filter_lines(keep, expr, names, f"rows whose {label} is 0 ({rows_at} in the failing batch): undefined "
                                 "there; find them in the data")
    return datafix.before_statement(s.source, s.source["line"], lines)


@rule("division_by_zero", aten.div, aten.reciprocal, priority=70)
def _div_zero(s: Site) -> Diagnosis | None:
    # in forward, or in backward code the user wrote (a custom autograd.Function's backward)
    if s.op_packet not in ("aten.div", "aten.reciprocal") or not (s.forward or s.event.frame is not None):
        return None
    if s.op_packet == "aten.div":
        if not s.call_is(*_DIVS):
            return None
        idx, which = 1, "other"
    else:  # 1 / y is y.reciprocal() * 1: the tensor is the right operand of `/`, the input of reciprocal()
        if not s.call_is("reciprocal", "__rdiv__", "__rtruediv__"):
            return None
        idx, which = 0, "other" if s.call_is("__rdiv__", "__rtruediv__") else "input"
    d = s.inp(idx)
    if not d.get("zeros"):
        return None
    num = s.inp(1 - idx) if s.op_packet == "aten.div" and len(s.inputs) > 1 else {"absmax": 1.0}
    zero_zero = s.event.kind == "nan"
    n = finite_float(num.get("absmax")) or 0.0
    if d.get("negatives"):  # a signed denominator: clamp_min would flip its sign; push exact zeros off 0 instead
        code, change, generic = plus_eps, (lambda t, e: t + e), (lambda e: f"add {fmt(e)} to the denominator")
        # the gradient reaches the denominator through `+ eps`: x / eps² must stay finite
        floor, floor_why = (math.sqrt(n / s.finfo.max) if n else None), "the gradient x / eps²"
    else:  # clamp_min: where it clamps, no gradient reaches the denominator; only the quotient x / eps must fit
        code, change, generic = clamp_eps, (lambda t, e: t.clamp_min(e)), \
            (lambda e: f"clamp the denominator to at least {fmt(e)}")
        floor, floor_why = (n / s.finfo.max if n else None), "the quotient x / eps"
    fixes = [] if d.get("negatives") else posfix.positive_fixes(s, idx, "the divisor")  # a ReLU made it
    fixes += edge_fix(s, FixKind.EPSILON, d.get("absmax") or n, "the quotient and its gradient",
                      code, change, generic, which=which, arg=idx, floor=floor, floor_why=floor_why,
                      data_eps=d.get("absmin_nonzero"), root=s.op_packet == "aten.div")
    return Diagnosis("division_by_zero", "0/0" if zero_zero else "division by zero",
                     f"the denominator held {count_in(d['zeros'], 'exact zero', d)} (range {stats.num(d.get('min'))} "
                     f".. {stats.num(d.get('max'))}) at {s.where}: {'0/0 = NaN' if zero_zero else 'x/0 = Inf'}. Keep "
                     "the denominator away from 0, or "
                     "mask the rows where it is 0.", fixes)
