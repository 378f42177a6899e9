"""F.kl_div with a target that carries a gradient and has exact zeros: reverse-KL or JS distillation that passes
the student's softmax as kl_div's *target*.

kl_div(input, target) is `xlogy(target, target) - target * input`. Its value at a target of 0 is fine (0), but
its derivative with respect to the target is log(target) + 1 - input: -inf where a softmax probability underflowed
to exactly 0 (a low temperature, a confident input), and the softmax's backward turns that into 0 * inf = NaN.
The loss stays finite; the gradients do not. The exact form gives kl_div the target's log-probabilities:
`F.kl_div(input, F.log_softmax(z, dim), log_target=True)`: log_softmax never takes log(0), and with
log_target=True the target's derivative is exp(t) (t - input + 1), 0 where exp(t) is 0. The values are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanreplay.diagnose.edits import codefix, crossline
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.rules.forms import _at, _line, _name
from nanreplay.diagnose.site import Site, packet
from nanreplay.enums import FixKind

aten = torch.ops.aten
ast = codefix.ast
_SOFTMAX = ("softmax",)


def _log_softmax_of(src, node) -> str | None:
    """`F.softmax(z, d)` / `torch.softmax(z, d)` / `z.softmax(d)` -> the same call as log_softmax."""
    if not (isinstance(node, ast.Call) and _name(node) in _SOFTMAX):
        return None
    text = src(node)
    head = src(node.func)
    return head[: -len("softmax")] + "log_softmax" + text[len(head):] if head.endswith("softmax") else None


def _text(src, node, defs: crossline.Definitions) -> str | None:
    """kl_div(input, softmax(z)) -> kl_div(input, log_softmax(z), ..., log_target=True); a target name assigned
    above as a softmax is followed there (`p = F.softmax(z, -1)` -> `logp = F.log_softmax(z, -1)`)."""
    if not (isinstance(node, ast.Call) and _name(node) == "kl_div") or any(k.arg == "log_target" for k in node.keywords):
        return None
    if len(node.args) >= 2:
        target, spell = node.args[1], None
    else:
        kw = next((k for k in node.keywords if k.arg == "target"), None)
        target, spell = (kw.value, "target=") if kw is not None else (None, None)
    if target is None or len(node.args) > 4:
        return None  # a positional log_target or reduction spelled by the deprecated arguments: leave it
    new = _log_softmax_of(src, target)
    if new is None and isinstance(target, ast.Name):
        d = defs.find(target.id)
        body = _log_softmax_of(d.src, d.value) if d is not None else None
        if body is None:
            return None
        new = defs.fresh(f"log_{target.id}")
        defs.replace(d, [f"{new} = {body}"] + ([f"{target.id} = torch.exp({new})"] if d.reused else []))
    if new is None:
        return None
    text, old = src(node), src(target)
    at = text.rfind(old)
    if at < 0 or not text.endswith(")"):
        return None
    text = text[:at] + new + text[at + len(old):]
    return text[:-1].rstrip().rstrip(",") + ", log_target=True)"


def _patch(s: Site, sm_call: int, kl_call: int, line: bool) -> dict:
    """Remember the softmax's arguments at its call; answer kl_div's call with log_softmax of them as the target,
    log_target=True (what the rewritten line computes)."""
    state: dict = {}
    sm_func: dict = {}

    def grab(func, args, kwargs):
        state["a"], sm_func["f"] = (args, kwargs), func
        return func(*args, **kwargs)

    def swap(func, args, kwargs):
        if "a" not in state:
            return func(*args, **kwargs)
        a, k = state.pop("a")
        if not (a and isinstance(a[0], torch.Tensor)):
            return func(*args, **kwargs)
        # a step program records F.softmax as aten._softmax(z, dim, half_to_float) and kl_div as its xlogy
        logt = aten._log_softmax(*a, **k) if "aten" in str(sm_func.get("f")) else F.log_softmax(*a, **k)
        if "kl_div" not in str(func):  # xlogy(t, t), kl_div's t·log t: the log-target form's exp(lt)·lt
            return torch.exp(logt) * logt
        kwargs = {key: v for key, v in kwargs.items() if key != "target"}
        return F.kl_div(args[0], logt, *args[2:], **{**kwargs, "log_target": True})
    each = s.line_calls if line else (lambda c: [c])
    return {**{c: grab for c in each(sm_call)}, **{c: swap for c in each(kl_call)}}


@rule("kl_div_target_zero", aten.xlogy, priority=176)  # before log_prob_at_support_edge (175): also an xlogy
def _kl_div_target_zero(s: Site) -> Diagnosis | None:
    user = s.step.user_call(s.call) or ""  # a step program records kl_div as the xlogy its composite makes
    if s.forward or s.event.node != "XlogyBackward0" or not (s.call_is("kl_div") or user.endswith("kl_div")):
        return None
    sm = s.origin(0)
    if sm is None or packet(str(sm.op)) != "aten._softmax" or not sm.call or sm.call == s.call:
        return None
    defs = crossline.Definitions(s.source, (s.source or {}).get("line"))
    rw = s.rewrite(lambda src, node: _text(src, node, defs))
    if rw is None and s.source and not s.library:  # the call as the user spelled it, not as the program named it
        rw = codefix.rewrite(s.source, s.source["line"], "kl_div", lambda src, node: _text(src, node, defs))
    rw = defs.attach(rw)
    if rw is not None and not crossline.covers(rw, [_line(sm), _line(s.rec)]):
        rw = None  # the softmax is not on a line the edit changes
    return Diagnosis(
        "kl_div_target_zero", "kl_div's gradient through a target probability of exactly 0",
        f"F.kl_div at {s.where} is given a softmax as its target ({_at(sm)}), and that target carries a gradient "
        "(reverse-KL or JS distillation: the student's probabilities). kl_div computes xlogy(target, target) - "
        "target * input, whose derivative with respect to the target is log(target) + 1 - input: -inf where a "
        "probability underflowed to exactly 0 (a low temperature or a confident input), and the softmax's "
        "backward turns that into 0 * inf = NaN. The loss is finite; only the gradient breaks. Passing the "
        "target's log-probabilities with log_target=True computes the same values, and its derivative there is 0.",
        [Fix(FixKind.LOG_TARGET, "", rewrite=rw, patch=_patch(s, sm.call, s.call, rw is not None),
             reasoning="log_softmax never takes log(0), and kl_div with log_target=True differentiates exp(t)·(t - "
                       "input), which is 0 where exp(t) underflows",
             guidance=f"give F.kl_div at {s.where} the target's log-probabilities, F.log_softmax(z, dim), and "
                      "log_target=True")])
