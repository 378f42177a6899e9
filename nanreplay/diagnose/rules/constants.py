"""Infinities that a constant or a masked value carries into arithmetic: 0 * inf and inf - inf.

* `mask_value_sign`: a mask filled with +inf (`-float('-inf')`, `float('inf')`): the softmax of a row holding
  +inf is inf - inf = NaN. The value meant is the most negative one; the mask line is rewritten to finfo.min.
* `constant_overflow`: a constant (a buffer, a 0-dim tensor) that is ±inf in the working dtype — GPT-2's
  `w * b - 1e10 * (1 - b)` with the 1e10 a buffer that `model.half()` made inf (1e10 > 65504) — multiplied by
  0 (the unmasked positions): kept at the dtype's largest finite value; or the cast that made such a constant
  inf (`torch.tensor(1e10).to(w.dtype)`): clamped to the dtype's range before the cast.
* `zero_times_inf`: `p * log p` where log p = -inf exactly where p = 0 (an entropy of a distribution whose
  masked logits are -inf): 0 * -inf = NaN, 0 by definition. The reformulation table's row (diagnose/forms.py)
  gives the exact form: the log clamped at the dtype's most negative finite value, 0 * it is 0, and its
  gradient there is 0 too (xlogy and special.entr take p, and their gradient at p = 0 is 0/0 or inf).
"""

from __future__ import annotations

import math

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.fixes import operand_fn, replace_arg
from nanreplay.diagnose.forms import TABLE
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site
from nanreplay.enums import FixKind
from nanreplay.replay import frame_json
from nanreplay.stats import num

aten = torch.ops.aten
ast = codefix.ast


# ------------------------------------------------------------------ a mask filled with +inf


def _is_pos_inf(node) -> bool:
    """float('inf'), math.inf / torch.inf / np.inf, -float('-inf'), -(-math.inf) as written in source."""
    if isinstance(node, ast.Attribute) and node.attr == "inf":
        return True
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "float" and len(node.args) == 1 \
            and isinstance(node.args[0], ast.Constant):
        return str(node.args[0].value).lower().lstrip("+") in ("inf", "infinity")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        from nanreplay.diagnose.rules.softmax import _is_neg_inf
        return _is_neg_inf(node.operand)
    return False


def _posinf_to_min(func, args, kwargs):
    """Run the call with every +inf constant argument replaced by the dtype's most negative finite value."""
    ref = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    lo = torch.finfo(ref.dtype if ref is not None else torch.float32).min

    def sub(a):
        if isinstance(a, float) and a == math.inf:
            return lo
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() == 0 and bool(torch.isposinf(a)):
            return torch.tensor(lo, dtype=a.dtype, device=a.device)
        return a
    return func(*[sub(a) for a in args], **{k: sub(v) for k, v in kwargs.items()})


@rule("mask_value_sign", aten._softmax, aten._log_softmax, priority=42)
def _mask_value_sign(s: Site) -> Diagnosis | None:
    """softmax of a row holding +inf that a constant put there (a mask value with the wrong sign)."""
    if not (s.forward and s.event.role == "conversion"):
        return None
    lits = [e for e in s.chain_events() if e.role == "literal" and e.index < s.event.index and e.fwd is not None
            and (e.out or {}).get("posinf")]
    recs = list({id(r): r for r in (s.step.ops[e.fwd] for e in lits) if r.call}.values())
    if not recs:
        return None
    from nanreplay.diagnose.rules.softmax import _finite_mask_text
    rws, calls = [], set()
    for r in recs:
        rw = s.rewrite(lambda src, node: _finite_mask_text(src, node, s.dtype, _is_pos_inf), r.call)
        calls.update(s.line_calls(r.call) if rw is not None else s.same_site(r.call))
        if rw and all(rw.before != o.before for o in rws):
            rws.append(rw)
    rws.sort(key=lambda r: r.line)
    where = ", ".join(sorted({f"{fr['file']}:{fr['line']}" for r in recs if (fr := frame_json(r.frame))}))
    row = TABLE["finite_mask"]
    return Diagnosis(
        "mask_value_sign", "a mask filled with +inf: the softmax of its row is NaN",
        f"the mask at {where} fills the masked positions with +inf, not -inf (`-float('-inf')` is +inf), so the "
        f"softmax at {s.where} computed exp(inf - inf) = NaN for every row holding one. A mask value must be the most "
        "negative one: the masked positions then get probability 0. Use torch.finfo(dtype).min (finite, so a row "
        "with every position masked stays finite too), where the mask is made.",
        [Fix(row.kind, "\n".join(r.after for r in rws), before="\n".join(r.before for r in rws) or None,
             after="\n".join(r.after for r in rws) or None, patch={c: _posinf_to_min for c in sorted(calls)} or None,
             guidance=None if rws else f"fill the mask at {where} with torch.finfo(dtype).min instead of +inf",
             reasoning="+inf as a mask value makes the masked position the row's maximum and inf - inf = NaN; "
                       "finfo(dtype).min masks it as -inf would, and stays finite")])


# ------------------------------------------------------------------ a constant that is inf in the working dtype


def _inf_sign(st: dict) -> int:
    """+1 / -1 where the input's infinities are known to be all of one sign, else 0."""
    if not st.get("inf"):
        return 0
    if not st.get("negatives"):
        return 1
    if st.get("negatives", 0) >= st.get("inf", 0) and (st.get("max") is None or st["max"] <= 0):
        return -1
    return 0


def _numel(st: dict) -> int:
    return math.prod(st.get("shape") or [])


def _finite_text(t: str, sign: int, dtype: str) -> str:
    """The operand kept at the dtype's finite range, on the side its infinities are on."""
    fi = f"torch.finfo(torch.{dtype})"
    if sign > 0:
        return f"{codefix.paren(t)}.clamp_max({fi}.max)"
    if sign < 0:
        return f"{codefix.paren(t)}.clamp_min({fi}.min)"
    return f"{codefix.paren(t)}.clamp({fi}.min, {fi}.max)"


def _operand_fix(s: Site, i: int, sign: int, **kw) -> tuple[codefix.Rewrite | None, dict | None]:
    """The culprit's i-th operand kept finite: the rewritten line (executed as shown) at every call it makes,
    else an op-level patch at the culprit's call."""
    which = "input" if i == 0 else "other"
    rw = s.rewrite(codefix.with_operand(which, lambda t: _finite_text(t, sign, s.dtype)))
    fi = torch.finfo(getattr(torch, s.dtype))
    fn = operand_fn(rw) or (lambda t: t.clamp(fi.min if sign <= 0 else None, fi.max if sign >= 0 else None))
    return rw, s.at_calls(replace_arg(i, fn), rewrite=rw)


def _inf_operand(s: Site) -> tuple[int, dict] | None:
    """(index, stats) of the one operand of a binary op that holds infinities, the other holding none."""
    ins = [(i, st) for i, st in enumerate(s.inputs[:2]) if st.get("inf")]
    if len(ins) != 1 or len(s.inputs) < 2 or any(st.get("nan") for st in s.inputs[:2]):
        return None
    return ins[0]


def _cast_target(s: Site) -> str | None:
    """The floating dtype a cast (aten._to_copy) made, from its recorded arguments ('torch.float16' -> 'float16')."""
    for v in s.event.scalars or []:
        name = v.split(".", 1)[1] if isinstance(v, str) and v.startswith("torch.") else ""
        if isinstance(getattr(torch, name, None), torch.dtype) and getattr(torch, name).is_floating_point:
            return name
    return None


def _cast_overflow(s: Site) -> Diagnosis | None:
    """A one-value constant cast to a dtype it is beyond (`torch.tensor(1e10).to(w.dtype)` in float16)."""
    st = s.inp(0)
    target = _cast_target(s)
    if target is None or _numel(st) > 1 or st.get("inf") or st.get("nan") or st.get("absmax") is None:
        return None
    fi = torch.finfo(getattr(torch, target))
    if st["absmax"] <= fi.max:
        return None
    sign = -1 if (st.get("max") or 0) < 0 else 1
    src = s.source

    def change(t: str) -> str:
        return _finite_text(t, sign, target)
    transform = codefix.with_operand("input", change)
    rw = s.rewrite(transform)
    if rw is None and src and not s.library:  # the cast as the user wrote it: x.to(dtype), x.half(), x.type(dtype)
        names = [n for n in ("to", "half", "type") if codefix.count_calls(src, src["line"], f"Tensor.{n}")]
        if len(names) == 1 and codefix.count_calls(src, src["line"], f"Tensor.{names[0]}") == 1:
            rw = codefix.rewrite(src, src["line"], f"Tensor.{names[0]}", transform)
    fn = operand_fn(rw) or (lambda x: x.clamp(fi.min, fi.max))
    return Diagnosis(
        "constant_overflow", f"a constant beyond {target}'s range is cast to inf",
        f"a constant of {num(st['absmax'])} is cast to {target} at {s.where}; {target}'s largest value is "
        f"{num(fi.max)}, so it becomes {'-' if sign < 0 else ''}inf (a mask constant such as 1e10, written for "
        f"float32), and what it meets next (0 * inf, inf - inf) is NaN. Keep it within {target}'s range: "
        f"torch.finfo(dtype).max, or mask with masked_fill(mask, torch.finfo(dtype).min).",
        [Fix(FixKind.FINITE_MASK_VALUE, "", rewrite=rw, patch=s.at_calls(replace_arg(0, fn), rewrite=rw),
             guidance=f"clamp the constant at {s.where} to {target}'s range before the cast: "
                      f"torch.finfo(torch.{target}).{'min' if sign < 0 else 'max'}",
             reasoning=f"torch.finfo({target}).max is as good a large value as any constant above it, and finite")])


@rule("constant_overflow", aten.mul, aten._to_copy, priority=45)
def _constant_overflow(s: Site) -> Diagnosis | None:
    """inf * 0 where the inf is a constant: a value beyond the working dtype's range; or the cast that made it."""
    if s.forward and s.event.role == "origin" and s.op_packet == "aten._to_copy" and s.event.kind == "inf":
        return _cast_overflow(s)
    if not (s.forward and s.event.role == "conversion" and s.op_packet == "aten.mul"):
        return None
    got = _inf_operand(s)
    if got is None:
        return None
    i, st = got
    if _numel(st) > 1 or st.get("inf") != max(1, _numel(st)):
        return None  # a constant: one value, and it is inf
    sign = _inf_sign(st)
    fi = s.finfo
    rw, patch = _operand_fix(s, i, sign)
    other = s.inp(1 - i)
    what = "0 * inf"
    return Diagnosis(
        "constant_overflow", f"a constant beyond {s.dtype}'s range is inf: {what} = NaN",
        f"a constant operand at {s.where} is {'+' if sign >= 0 else '-'}inf in {s.dtype}: a value above {s.dtype}'s "
        f"largest, {num(fi.max)}, becomes inf when it is cast (a mask constant such as 1e10 kept as a buffer, then "
        f"model.half()); its other operand holds {other.get('zeros', 0)} zeros, and {what} is NaN there. Keep the "
        f"constant at {s.dtype}'s largest finite value (torch.finfo(dtype).max), or mask with masked_fill(mask, "
        "torch.finfo(dtype).min) instead of arithmetic with a large constant.",
        [Fix(FixKind.FINITE_MASK_VALUE, "", rewrite=rw, patch=patch,
             guidance=f"keep the constant at {s.where} within {s.dtype}'s range: torch.finfo(torch.{s.dtype}).max",
             reasoning=f"torch.finfo({s.dtype}).max is as good a large value as any constant above it, and finite: "
                       f"times 0 it is 0",
             alternatives=["scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)  # instead of "
                           "scores * mask - C * (1 - mask)"])])


# ------------------------------------------------------------------ p * log p at p = 0: 0 * -inf


@rule("zero_times_inf", aten.mul, priority=44)
def _zero_times_inf(s: Site) -> Diagnosis | None:
    """p * log p where log p is -inf exactly where p is 0 (every inf met a zero): the term is 0 by definition."""
    if not (s.forward and s.event.role == "conversion" and s.op_packet == "aten.mul"):
        return None
    got = _inf_operand(s)
    if got is None:
        return None
    i, st = got
    zeros = s.inp(1 - i).get("zeros") or 0
    out = s.event.out or {}
    if _numel(st) <= 1 or zeros < st["inf"] or out.get("nan") != st["inf"] or out.get("posinf") or out.get("neginf"):
        return None  # every infinity met a zero, and nothing else went non-finite
    sign = _inf_sign(st)
    row = TABLE["zero_times_inf"]
    rw, patch = _operand_fix(s, i, sign)
    return Diagnosis(
        "zero_times_inf", "0 * inf: p * log p where p = 0 and log p = -inf",
        f"one factor of the product at {s.where} is inf at {st['inf']} positions and the other is exactly 0 at each "
        "of them (p * log p of an entropy, where a masked logit of -inf gives p = 0 and log p = -inf): 0 * inf = NaN, "
        "while the term is 0 by definition. Keep the infinite factor at the dtype's finite range: the product is "
        "then 0 there, with a gradient of 0, and unchanged everywhere else.",
        [Fix(row.kind, "", rewrite=rw, patch=patch, reasoning=row.why,
             guidance=f"at {s.where}, clamp the factor that is -inf to torch.finfo(dtype).min: {row.exact}")])
