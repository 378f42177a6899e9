"""An exp that underflowed to exactly 0 and then met a log: a Gaussian policy's std = exp(log_std) below
float32's smallest number (log_std < -104), whose Normal.log_prob takes log(scale) and divides by scale ** 2.

The log is where the -inf is made, inside torch.distributions, so log_of_zero's ε has no line of the user's to
go on. The value the user can bound is the exponent, where the exp is taken: `torch.exp(self.log_std(obs))`
becomes `torch.exp(self.log_std(obs).clamp(min=-5))` (the log-std bounds of rsl_rl, SAC and CleanRL). The bounds
are tried tightest first: a bound that moves a healthy exp fails the no-op check and the next is tried; what the
exp feeds divides by its square, so the loosest keeps exp(2 * bound) a normal number of the dtype.
"""

from __future__ import annotations

import math

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.fixes import operand_fn, replace_arg
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site, packet
from nanreplay.enums import FixKind
from nanreplay.replay import frame_json

aten = torch.ops.aten


@rule("exp_underflow", aten.log, priority=183)  # before log_of_zero (180): its ε would go on a line of torch's
def _exp_underflow(s: Site) -> Diagnosis | None:
    if not (s.forward and s.event.kind == "inf"):
        return None
    x = s.inp(0)
    if not x.get("zeros") or x.get("negatives"):
        return None
    e = s.origin(0)
    if e is None or packet(str(e.op)) != "aten.exp" or not e.call:
        return None
    src = s.source
    if src and any(codefix.count_calls(src, src["line"], n) for n in ("log", "log_")):
        return None  # the log is the user's own call: log(exp(x)) is x, and log_of_zero's fixes go on that line
    loosest = -math.floor(-math.log(s.finfo.tiny) / 2)  # exp(2 * bound) stays a normal number (float32: -43)
    fr = frame_json(e.frame)
    at = f"{fr['file']}:{fr['line']}" if fr else "where the exp is taken"
    fixes = []
    for b in dict.fromkeys((-5, -10, -20, loosest)):
        rw = s.rewrite(codefix.with_operand("input", lambda t, b=b: f"{codefix.paren(t)}.clamp(min={b})"), e.call)
        fn = operand_fn(rw) or (lambda t, b=b: t.clamp(min=b))
        fixes.append(Fix(FixKind.CLAMP, "", rewrite=rw, patch=s.at_calls(replace_arg(0, fn), e.call, rw),
                         guidance=f"clamp exp's input to at least {b} at {at}",
                         reasoning=f"exp(x) is exactly 0 in {s.dtype} below x ≈ {math.log(s.finfo.tiny * s.finfo.eps):.0f}"
                                   f"; a lower bound of {b} keeps it at least {math.exp(b):.1e}, and cuts the gradient "
                                   "only where the bound binds"))
    return Diagnosis("exp_underflow", "exp underflowed to 0, then its log is -inf",
                     f"an exp at {at} underflowed to exactly 0 ({x.get('zeros')} value(s)), and log(0) = -inf at "
                     f"{s.where} (inside {s.library or 'the call'}: a distribution's log(scale) with scale = exp(log "
                     "std), typically). log(exp(x)) is x, but the log here is not yours to rewrite: bound the exponent "
                     "where the exp is taken.", fixes)
