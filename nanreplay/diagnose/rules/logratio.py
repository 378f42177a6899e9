"""A softmax probability written as a ratio of exps and then logged: -log(exp(a) / exp(S).sum(d)), the InfoNCE /
NT-Xent loss as lightning-bolts first wrote it (pos = exp(sim_ii / t), neg = exp(sim / t).sum(-1),
-log(pos / neg)). With unnormalised projections sim / t passes 88, both exps overflow, inf / inf = NaN.

The composition is a log-softmax entry: log(exp(a) / sum(exp(S))) = a - logsumexp(S, d), exact for every input.
A max-subtraction in one exp (handwritten_softmax's answer for a lone `exp(x) / exp(x).sum()`) leaves the other
overflowing. The edit is the log's line, in the user's own expressions: each name it divides (`pos`, `neg`) is
followed to its assignment in the lines the snapshot recorded (diagnose/edits/crossline.py); those assignments stay
(their exps no longer reach the loss). Replayed by remembering both exps' arguments and answering the log call.
"""

from __future__ import annotations

import torch

from nanreplay.diagnose.edits import codefix, crossline
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site, packet
from nanreplay.enums import FixKind

aten = torch.ops.aten
ast = codefix.ast


def _exp_of(node, defs: crossline.Definitions, src):
    """(text of x, src) for exp(x) / x.exp(), looking through a name to its assignment."""
    if isinstance(node, ast.Name):
        d = defs.find(node.id)
        if d is None or d.reused:
            return None
        node, src = d.value, d.src
    if isinstance(node, ast.Call) and codefix._callee(node) == "exp":
        x = codefix.operand(node, "input")
        return (src(x), node) if x is not None else None
    return None


def _sum_of_exp(node, defs: crossline.Definitions, src):
    """(text of S, dim) for exp(S).sum(d) / torch.sum(torch.exp(S), d), through a name; dim a literal int."""
    if isinstance(node, ast.Name):
        d = defs.find(node.id)
        if d is None or d.reused:
            return None
        node, src = d.value, d.src
    if not (isinstance(node, ast.Call) and codefix._callee(node) == "sum") or node.keywords:
        return None
    fn = codefix._is_function_call(node)
    inner = node.args[0] if fn and node.args else (node.func.value if not fn else None)
    rest = node.args[1:] if fn else node.args
    got = _exp_of(inner, defs, src) if inner is not None else None
    if got is None or len(rest) != 1:
        return None
    try:
        dim = ast.literal_eval(rest[0])
    except ValueError:
        return None
    return (got[0], dim) if isinstance(dim, int) and not isinstance(dim, bool) else None


def _text(src, node, defs: crossline.Definitions) -> str | None:
    """torch.log(P / N) with P = exp(a), N = exp(S).sum(d) -> (a - torch.logsumexp(S, d))."""
    if not (isinstance(node, ast.Call) and codefix._callee(node) == "log"):
        return None
    ratio = codefix.operand(node, "input")
    if not (isinstance(ratio, ast.BinOp) and isinstance(ratio.op, ast.Div)):
        return None
    num, den = _exp_of(ratio.left, defs, src), _sum_of_exp(ratio.right, defs, src)
    if num is None or den is None:
        return None
    return f"({num[0]} - torch.logsumexp({den[0]}, {den[1]}))"


@rule("log_ratio_of_exps", aten.exp, priority=61)  # before handwritten_softmax (60): it would fix one exp of two
def _log_ratio(s: Site) -> Diagnosis | None:
    if not (s.forward and s.call_is("exp") and s.event.kind == "inf"):
        return None
    me = s.index(s.rec)
    div = next((s.step.ops[i] for i in s.consumers() if packet(str(s.step.ops[i].op)) == "aten.div"
                and tuple(s.step.ops[i].src[:1]) == (me,)), None)
    if div is None:
        return None
    di = s.index(div)
    log = next((s.step.ops[i] for i in s.consumers(di) if packet(str(s.step.ops[i].op)) == "aten.log"), None)
    total = s.origin(1, div)
    if log is None or not log.call or total is None or packet(str(total.op)) != "aten.sum":
        return None
    other = s.origin(0, total)
    if other is None or packet(str(other.op)) != "aten.exp" or not other.call or other.call == s.call:
        return None
    src = s.source_of(log.call)
    defs = crossline.Definitions(src, src["line"] if src else None)
    rw = defs.attach(s.rewrite(lambda sr, node: _text(sr, node, defs), log.call))
    if rw is None:
        return None
    dim = int(rw.after.rsplit("torch.logsumexp(", 1)[1].rsplit(",", 1)[1].split(")")[0])
    state: dict = {}

    def grab(key):
        def fn(func, args, kwargs):
            state[key] = args[0]
            return func(*args, **kwargs)
        return fn

    def answer(func, args, kwargs):
        if "a" not in state or "s" not in state:
            return func(*args, **kwargs)
        return state.pop("a") - torch.logsumexp(state.pop("s"), dim)
    patch = {s.call: grab("a"), other.call: grab("s"), log.call: answer}
    return Diagnosis(
        "log_ratio_of_exps", "log of a softmax written as a ratio of exps",
        f"exp overflowed {s.dtype} at {s.where} (and in the sum of exps it is divided by), so the ratio was inf / inf "
        f"= NaN before the log. log(exp(a) / sum(exp(S))) is a - logsumexp(S): one entry of a log_softmax (the "
        "InfoNCE / NT-Xent loss is cross_entropy over the similarities), which never forms exp of a large number.",
        [Fix(FixKind.LOG_SOFTMAX, "", rewrite=rw, patch=patch,
             guidance="replace log(exp(a) / exp(S).sum(d)) by a - torch.logsumexp(S, d)",
             reasoning="a - logsumexp(S, d) equals log(exp(a) / sum(exp(S))) wherever that is finite, and is finite "
                       "where the exps overflow")])
