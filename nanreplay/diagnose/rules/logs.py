"""The log family: log / log2 / log10 of zero or a negative, and the stable forms a log of
something should have been (log_softmax, logsigmoid, binary_cross_entropy_with_logits, xlogy).

Their fix kinds and reasoning come from the reformulation table (diagnose/forms.py). The stable-form
patterns outrank a plain log of zero (they are more specific and their fix is better); a log whose
result where() picks from is the where trap (rules/where.py, above log_of_zero), so the stable-form
rules leave it alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nanreplay.diagnose.edits import bcefix, codefix, lsmfix, posfix, selfix
from nanreplay.diagnose.fixes import (
    choose_eps,
    clamp_eps,
    edge_fix,
    eps_candidates,
    fmt,
    nonneg_eps,
    operand_fn,
    replace_arg,
    stable_log_patch,
)
from nanreplay.diagnose.forms import TABLE as FORMS
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.prose import count_in
from nanreplay.diagnose.site import Site, packet
from nanreplay.enums import FixKind
from nanreplay.replay import OpRecord, frame_json
from nanreplay.stats import num

aten = torch.ops.aten


_LOGS = (aten.log, aten.log2, aten.log10)
_LOG_PACKETS = ("aten.log", "aten.log2", "aten.log10")


def _log_family(s: Site) -> bool:
    return s.packet in _LOG_PACKETS and s.call_is("log", "log2", "log10")


def _stable_log_candidate(s: Site) -> bool:
    """A log the stable-form rules may claim: not one whose result where() picks from (the where trap)."""
    return _log_family(s) and "aten.where" not in s.consumer_packets()


def _softmax_dim(args, kwargs) -> int:
    return kwargs.get("dim", args[1] if len(args) > 1 else -1)


def _wrapped_call_text(node, src, inner_name: str, new_fn: str) -> str | None:
    """log(inner(a, ...)) / inner(a, ...).log() -> new_fn(a, ...): the user's arguments, kept as written."""
    f = node.func if isinstance(node, codefix.ast.Call) else None
    if f is None or (f.attr if isinstance(f, codefix.ast.Attribute) else getattr(f, "id", "")) != "log":
        return None  # log2 / log10: no one-call rewrite
    inner = codefix.operand(node, "input")
    if not isinstance(inner, codefix.ast.Call):
        return None
    g = inner.func
    if (g.attr if isinstance(g, codefix.ast.Attribute) else getattr(g, "id", "")) != inner_name:
        return None
    if codefix._is_function_call(inner):
        parts = [src(a) for a in inner.args]
    else:
        parts = [src(g.value)] + [src(a) for a in inner.args]
    parts += [f"{k.arg}={src(k.value)}" for k in inner.keywords]
    return f"{new_fn}({', '.join(parts)})"


def _frame_at(rec: OpRecord) -> str:
    fr = frame_json(rec.frame)
    return f"{fr['file']}:{fr['line']}" if fr else "where it is computed"


def _sigmoid_one(fi: torch.finfo) -> float:
    """The z above which torch.sigmoid(z) is exactly 1 in this dtype (measured, to the nearest 0.5)."""
    z = torch.arange(0.0, 200.0, 0.5).to(getattr(torch, fi.dtype))
    ones = z[torch.sigmoid(z) == 1]
    return float(ones.min()) if ones.numel() else math.inf


def _sigmoid_zero(fi: torch.finfo) -> float:
    """The z below which torch.sigmoid(z) is exactly 0 in this dtype (measured, to the nearest 0.5)."""
    z = torch.arange(-200.0, 0.0, 0.5).to(getattr(torch, fi.dtype))
    zeros = z[torch.sigmoid(z) == 0]
    return float(zeros.max()) if zeros.numel() else -math.inf


def _sigmoid_logs(s: Site, sg: OpRecord) -> tuple[list[OpRecord], list[OpRecord], list[OpRecord]]:
    """The logs of p = sigmoid(z) and of 1 - p in this step: (log(p) ops, log(1 - p) ops, the 1 - p ops)."""
    direct, of_complement, complements = [], [], []
    for op in s.step.ops:
        if packet(str(op.op)) not in _LOG_PACKETS:
            continue
        o = s.origin(0, op)
        if o is sg:
            direct.append(op)
        elif o is not None and packet(str(o.op)) in ("aten.rsub", "aten.sub") and \
                any(s.origin(i, o) is sg for i in range(len(o.src))):
            of_complement.append(op)
            complements.append(o)
    return direct, of_complement, complements


@rule("bce_saturated", *_LOGS, priority=230)
def _handwritten_bce(s: Site) -> Diagnosis | None:
    """-(y log p + (1 - y) log(1 - p)) with p = sigmoid(z): p rounds to exactly 0 or 1, one log is log(0)."""
    if not _stable_log_candidate(s):
        return None
    o = s.origin(0)
    if o is None:
        return None
    if packet(str(o.op)) == "aten.sigmoid":
        sg = o
    elif packet(str(o.op)) in ("aten.rsub", "aten.sub"):
        sg = next((s.origin(i, o) for i in range(len(o.src)) if s.origin_packet(i, o) == "aten.sigmoid"), None)
    else:
        sg = None
    if sg is None:
        return None
    direct, of_complement, complements = _sigmoid_logs(s, sg)
    if not of_complement:
        return None  # log(sigmoid(z)) alone: the logsigmoid rule
    rw, note = bcefix.edits(s, sg, direct + of_complement, complements)
    patch = stable_log_patch(sg, direct + of_complement, lambda a, k: F.logsigmoid(a[0]), complements,
                             every=s.line_calls if rw else None)
    Fn = codefix.functional(s.source)
    at = _frame_at(sg) if sg.frame is not None else f"the model's module {sg.module!r} (its line is not yours)"
    guide = (f"at {at}, return the logits (what goes into the sigmoid) instead of the sigmoid's output,\n"
             f"and compute the loss from them with {Fn}.binary_cross_entropy_with_logits(logits, target)\n"
             f"(by hand: log(p) becomes {Fn}.logsigmoid(logits), log(1 - p) becomes {Fn}.logsigmoid(-logits))")
    which = "1, so log(1 - p) = log(0)" if s.origin(0) is not sg else "0, so log(p) = log(0)"
    return Diagnosis(
        "bce_saturated", "hand-written binary cross-entropy on a saturated sigmoid",
        f"p = sigmoid(z) rounded to exactly {which} = -inf at {s.where}: in {s.dtype}, sigmoid(z) is exactly 1 "
        f"for z above about {_sigmoid_one(s.finfo):.0f} and exactly 0 below about {_sigmoid_zero(s.finfo):.0f}. "
        "Computing binary cross-entropy from probabilities loses everything beyond float precision; "
        f"compute it from the logits (sigmoid at {at}).",
        [Fix(FORMS["bce_with_logits"].kind, "", rewrite=rw, guidance=guide, patch=patch,
             reasoning=FORMS["bce_with_logits"].why + note)])


@rule("logsigmoid", *_LOGS, priority=220)
def _log_of_sigmoid(s: Site) -> Diagnosis | None:
    sg = s.origin(0)
    if sg is None or packet(str(sg.op)) != "aten.sigmoid" or not _stable_log_candidate(s):
        return _log_of_selection(s, "sigmoid")
    Fn = codefix.functional(s.source)
    rw = s.rewrite(lambda src, node: _wrapped_call_text(node, src, "sigmoid", f"{Fn}.logsigmoid"))
    patch = stable_log_patch(sg, [s.rec], lambda a, k: F.logsigmoid(a[0]), every=s.line_calls if rw else None)
    guide = f"replace log(sigmoid(...)) by {Fn}.logsigmoid(...) of the same argument (the sigmoid is at {_frame_at(sg)})"
    return Diagnosis(
        "logsigmoid", "log(sigmoid(x)): sigmoid saturated to 0 and log made it -inf",
        f"sigmoid(x) rounds to exactly 0 in {s.dtype} for x below about {_sigmoid_zero(s.finfo):.0f}, and "
        f"log(0) = -inf at {s.where}.",
        [Fix(FORMS["logsigmoid"].kind, "", rewrite=rw, guidance=guide, patch=patch, reasoning=FORMS["logsigmoid"].why)])


@rule("log_softmax", *_LOGS, priority=210)
def _log_of_softmax(s: Site) -> Diagnosis | None:
    sm = s.origin(0)
    if sm is None or packet(str(sm.op)) not in ("aten._softmax", "aten.softmax") or not _stable_log_candidate(s):
        return _log_of_selection(s, "softmax")
    rw = s.rewrite(lambda src, node: _wrapped_call_text(node, src, "softmax", "torch.log_softmax"))
    note = ""
    if rw is None:  # the softmax is made in another function (the model's forward): an edit of each line
        rw, note = lsmfix.edits(s, sm)
    patch = stable_log_patch(sm, [s.rec], lambda a, k: torch.log_softmax(a[0], dim=_softmax_dim(a, k)),
                             every=s.line_calls if rw else None)
    guide = (f"replace log(softmax(...)) by torch.log_softmax(...) with the same arguments (the softmax is at "
             f"{_frame_at(sm)})")
    return Diagnosis(
        "log_softmax", "log(softmax(x)): softmax underflowed to 0 and log made it -inf",
        f"softmax returned exactly 0 for some entries (their logits were far below the row's maximum), "
        f"and log(0) = -inf {'in forward' if s.forward else 'gave 0/0 = NaN in its backward (grad / p)'}. "
        f'This is the `log(softmax(x))` collapse of "Debugging Gradients That Misbehave", at {s.where}.',
        [Fix(FORMS["log_softmax"].kind, "", rewrite=rw, guidance=guide, patch=patch,
             reasoning=FORMS["log_softmax"].why + note)])


def _log_of_selection(s: Site, kind: str) -> Diagnosis | None:
    """log of a selection (gather, indexing, a one-hot product-sum) of a softmax / sigmoid: the selection of its
    log_softmax / logsigmoid (diagnose/edits/selfix.py). Claimed only where the user's lines can be edited: else
    log_of_zero's ε is the fix that can be applied."""
    got = selfix.selected(s) if _stable_log_candidate(s) else None
    if got is None or packet(str(got[0].op)) not in (("aten._softmax", "aten.softmax") if kind == "softmax"
                                                      else ("aten.sigmoid",)):
        return None
    inner, sels = got
    rw, note = selfix.edits(s, inner, sels, kind)
    if rw is None:
        return None
    if kind == "softmax":
        row, name, made = FORMS["log_softmax"], "log_softmax", "torch.log_softmax(x, dim)"

        def stable(a, k):
            return torch.log_softmax(a[0], dim=_softmax_dim(a, k))
    else:
        row, name, made = FORMS["logsigmoid"], "logsigmoid", f"{codefix.functional(s.source)}.logsigmoid(x)"

        def stable(a, k):
            return F.logsigmoid(a[0])
    patch = selfix.patch(inner, sels, s.rec, stable, every=s.line_calls)
    words = {"aten.index": "indexing", "aten.sum": "a one-hot product-sum", "aten.mul": "a one-hot product-sum"}
    how = ", ".join(dict.fromkeys(words.get(packet(str(r.op)), packet(str(r.op)).split(".", 1)[1]) for r in sels
                                  if packet(str(r.op)) != "aten.add" and r in selfix._selections(sels))) or \
        "the whole output, plus an ε"
    guide = (f"take {made} at {_frame_at(inner)} and select from it as the log's argument selects from the "
             f"{kind} ({how}): the log of a selection is the selection of the log")
    return Diagnosis(
        name, f"log of a selection of {kind}(x): the selected entry underflowed to 0 and log made it -inf",
        f"{kind} returned exactly 0 for some entries, and the entries selected from it ({how}) reached log as "
        f"exact zeros: log(0) = -inf {'in forward' if s.forward else 'gave 0/0 = NaN in its backward'} at "
        f"{s.where}. The log of a selection is the selection of the log, so {made} selected the same way is exact "
        f"and never takes log(0).",
        [Fix(row.kind, "", rewrite=rw, guidance=guide, patch=patch, reasoning=row.why + note)])


@rule("zero_times_log_zero", *_LOGS, priority=200)
def _zero_log_zero(s: Site) -> Diagnosis | None:
    """p * log(p) with p == 0: log gives -inf, the product 0 * -inf = NaN."""
    if not (s.forward and s.event.kind == "inf" and _log_family(s)):
        return None
    mul = next((i for i in s.consumers() if packet(str(s.step.ops[i].op)) == "aten.mul"), None)
    conv = [e for e in s.chain_events() if e.role == "conversion" and e.fwd == mul]
    if mul is None or not conv:
        return None
    mrec = s.step.ops[mul]
    p = s.origin(0)  # p * log(p): the product's other factor is the log's own input
    others = [s.origin(i, mrec) for i in range(len(mrec.src)) if mrec.src[i] != s.event.fwd]
    if not any(o is p for o in others):
        return None  # y * log(p) with data y: an ordinary log of zero
    scale = s.inp(0).get("absmax")
    eps, why = choose_eps(s.dtype, scale, "log(p + eps) and its gradient")
    fixes = []
    if mrec.call and s.call:
        state: dict = {}

        def grab_log(func, args, kwargs):
            out = func(*args, **kwargs)
            state["p"], state["logp"] = args[0], out
            return out

        def xlogy(func, args, kwargs):
            others = [a for a in args if not (isinstance(a, torch.Tensor) and a is state.get("logp"))]
            q = others[0] if others else state["p"]
            return torch.special.xlogy(q, state["p"])
        rw = s.rewrite(_xlogy_text, mrec.call)
        patch = {s.call: grab_log, mrec.call: xlogy}
        if rw is not None:
            patch = {**{c: grab_log for c in s.line_calls(s.call)}, **{c: xlogy for c in s.line_calls(mrec.call)}}
        fixes.append(Fix(FixKind.XLOGY, "", rewrite=rw, patch=patch,
                         guidance=f"compute p * log(p) as torch.special.xlogy(p, p) at {s.where}: it is 0 where p == 0",
                         reasoning="xlogy(x, y) = x*log(y) with 0 where x == 0 — but its gradient with respect "
                                   "to y is x/y, still 0/0 = NaN at p == 0"))
    def made(e: float):
        rw = s.rewrite(codefix.with_operand("input", lambda t, e=e: f"{codefix.paren(t)}.clamp_min({fmt(e)})"))
        fn = operand_fn(rw) or (lambda t, e=e: t.clamp_min(e))
        return rw, s.at_calls(replace_arg(0, fn), rewrite=rw)
    for e, why_e in eps_candidates(eps, why):
        rw, patch = made(e)
        fixes.append(Fix(FixKind.CLAMP, "", epsilon=e, rewrite=rw, probe=made(e * 100)[1],
                         guidance=f"clamp log's input to at least {fmt(e)} inside p * log(p) at {s.where}",
                         patch=patch,
                         reasoning=f"clamping inside the log keeps p*log(p) = 0 at p = 0 with finite gradients; {why_e}"))
    return Diagnosis(
        "zero_times_log_zero", "0 * log(0): an entropy-style term p*log(p) at p = 0",
        f"p held exact zeros, log(p) = -inf at {s.where}, and the product 0 * -inf is NaN. "
        "Mathematically the term is 0 there; numerically it is NaN.", fixes)


def _xlogy_text(src, node) -> str | None:
    """p * torch.log(p) -> torch.special.xlogy(p, p): the product whose one factor is a log call."""
    ast = codefix.ast
    if not isinstance(node, ast.BinOp):
        return None
    sides = [(node.left, node.right), (node.right, node.left)]
    for log, other in sides:
        if isinstance(log, ast.Call) and codefix._callee(log) == "log":
            x = codefix.operand(log, "input")
            return f"torch.special.xlogy({src(other)}, {src(x)})" if x is not None else None
    return None


@rule("log_of_zero", *_LOGS, priority=180)
def _log_zero(s: Site) -> Diagnosis | None:
    if not _log_family(s):
        return None
    x = s.inp(0) if s.forward else s.inp(1)  # backward: LogBackward0 divides grad by x
    if s.forward and x.get("zeros", 0) == 0:
        return None
    if not s.forward and s.event.node not in ("LogBackward0", "Log2Backward0", "Log10Backward0"):
        return None
    if s.forward and x.get("negatives", 0):
        return None  # negatives: the log_of_negative rule
    fixes = posfix.positive_fixes(s, 0, "log's input")  # a ReLU made it: the parametrisation is the edge
    fixes += edge_fix(s, FixKind.EPSILON, x.get("absmax"), "log(x + eps) and its gradient 1/(x + eps)",
                     *nonneg_eps(s, "log's input"),
                     floor=1 / s.finfo.max, floor_why="the gradient 1/(x + eps)", data_eps=x.get("absmin_nonzero"))
    what = "-inf in forward" if s.forward else "0/0 = NaN in its backward (grad / x with x = 0)"
    return Diagnosis("log_of_zero", "log of zero",
                     f"log received {count_in(x.get('zeros', 0), 'exact zero', x)} at {s.where}: log(0) = -inf, "
                     f"and here that became {what}.", fixes)


@rule("log_of_negative", *_LOGS, priority=170)
def _log_negative(s: Site) -> Diagnosis | None:
    x = s.inp(0)
    if not (s.forward and _log_family(s) and x.get("negatives", 0)):
        return None
    fixes = edge_fix(s, FixKind.CLAMP, x.get("absmax"), "log(x.clamp_min(eps)) and its gradient",
                     clamp_eps, lambda t, e: t.clamp_min(e), lambda e: f"clamp log's input to at least {fmt(e)}",
                     floor=1 / s.finfo.max, floor_why="the gradient 1/eps", data_eps=x.get("absmin_nonzero"))
    return Diagnosis("log_of_negative", "log of a negative number",
                     f"log received {count_in(x['negatives'], 'negative value', x)} (min {num(x.get('min'))}) at {s.where}: "
                     "log(x<0) = NaN. Check why the input can be negative; clamp it if that is expected.", fixes)
