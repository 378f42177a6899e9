"""Why the culprit broke the step, and what to change — one registry of cause rules.

Each rule is registered with `@rule(cause, *aten_ops)`; the decorator fails
loudly on a duplicate cause or on a target that is not an aten op. A rule looks
at a `Site` (the culprit event plus its context: op, phase, input statistics,
what produced the op's inputs, what consumed its output, dtype, chain) and
returns a `Diagnosis` or None. Rules are tried in registration order: specific
patterns first, then generic ones, then an honest "unrecognised" diagnosis.

Every fix that is a code change carries a *patch*: a rewrite of exactly the
culprit's call site(s), keyed by the call number the replay recorded. The fix is
then verified by replaying the step with the patch; the first candidate that
makes the loss and every gradient finite is reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from nanreplay import codefix, verify
from nanreplay.replay import Event, OpRecord, Step, frame_json

aten = torch.ops.aten

FIX_KINDS = ("epsilon", "clamp", "log_softmax", "logsigmoid", "xlogy", "bce_with_logits", "max_subtraction",
             "finite_mask_value", "double_where", "correction", "bf16_or_grad_scaler", "lower_lr_clip_grads",
             "clean_input", "restore_parameters", "guard_empty_reduction", "none")


@dataclass
class Fix:
    kind: str
    code: str  # the change, as code for this site
    epsilon: float | None = None
    reasoning: str = ""
    before: str | None = None  # the user's statement as written (when the source is readable)
    after: str | None = None
    patch: dict[int, Callable] | None = None  # call number -> rewrite, for verification
    variant: dict | None = None  # a whole-step change for verification (dtype / autocast)
    verified: bool | None = None
    verification: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FIX_KINDS:
            raise ValueError(f"unknown fix kind {self.kind!r}")

    def to_json(self) -> dict:
        return {"kind": self.kind, "code": self.code, "epsilon": self.epsilon, "verified": self.verified,
                "verification": self.verification, "reasoning": self.reasoning, "before": self.before,
                "after": self.after}


@dataclass
class Diagnosis:
    cause: str
    title: str
    explanation: str
    fixes: list[Fix] = field(default_factory=list)


@dataclass(frozen=True)
class Rule:
    cause: str
    ops: frozenset[str]
    fn: Callable[[Site], Diagnosis | None]


RULES: list[Rule] = []


def rule(cause: str, *ops: Any) -> Callable:
    """Register a cause rule for culprits whose forward op is one of `ops` (none: any op)."""
    names = set()
    for op in ops:
        if not isinstance(op, torch._ops.OpOverloadPacket):
            raise TypeError(f"rule {cause!r}: {op!r} is not an aten op (use torch.ops.aten.<name>)")
        names.add(str(op))

    def deco(fn: Callable[[Site], Diagnosis | None]) -> Callable:
        if any(r.cause == cause for r in RULES):
            raise ValueError(f"cause {cause!r} is registered twice")
        RULES.append(Rule(cause, frozenset(names), fn))
        return fn

    return deco


def packet(op: str | None) -> str | None:
    """'aten.sqrt.default' -> 'aten.sqrt'."""
    return op.rsplit(".", 1)[0] if op else None


# ------------------------------------------------------------------ the culprit, as rules see it


@dataclass
class Site:
    step: Step
    event: Event
    chain: list[int]
    subject: Any  # rebuild.Subject

    @cached_property
    def rec(self) -> OpRecord | None:
        return self.step.ops[self.event.fwd] if self.event.fwd is not None else None

    @property
    def forward(self) -> bool:
        return self.event.phase == "forward"

    @property
    def fwd_op(self) -> str | None:
        return str(self.rec.op) if self.rec else None

    @property
    def packet(self) -> str | None:
        return packet(self.fwd_op)

    @property
    def op_packet(self) -> str:
        return packet(self.event.op)

    @property
    def inputs(self) -> list[dict]:
        return self.event.inputs or []

    def inp(self, i: int) -> dict:
        return self.inputs[i] if i < len(self.inputs) else {}

    @property
    def dtype(self) -> str:
        for st in self.inputs:
            if st.get("dtype", "").startswith(("float", "bfloat")):
                return st["dtype"]
        return "float32"

    @property
    def finfo(self) -> torch.finfo:
        return torch.finfo(getattr(torch, self.dtype))

    @property
    def call(self) -> int:
        return self.rec.call if self.rec else 0

    @property
    def call_name(self) -> str:
        c = self.call
        return self.step.call_names[c] if 0 < c < len(self.step.call_names) else ""

    def call_is(self, *names: str) -> bool:
        """Did the user spell the culprit call as one of these (torch.log / Tensor.log / ...)?"""
        base = self.call_name.rsplit(".", 1)[-1]
        return base in names

    def src(self, i: int, rec: OpRecord | None = None) -> OpRecord | None:
        """The forward op that produced the i-th tensor input of `rec` (default: the culprit's forward op)."""
        rec = rec or self.rec
        if rec is None or i >= len(rec.src) or rec.src[i] is None:
            return None
        return self.step.ops[rec.src[i]]

    def src_packet(self, i: int, rec: OpRecord | None = None) -> str | None:
        r = self.src(i, rec)
        return packet(str(r.op)) if r else None

    def consumers(self, fwd: int | None = None) -> list[int]:
        """Forward ops that took the output of forward op `fwd` (default: the culprit's) as input."""
        fwd = self.event.fwd if fwd is None else fwd
        return [i for i, r in enumerate(self.step.ops) if fwd in r.src]

    def consumer_packets(self, fwd: int | None = None) -> list[str]:
        return [packet(str(self.step.ops[i].op)) for i in self.consumers(fwd)]

    @property
    def frame(self) -> tuple | None:
        return self.step.frame_of(self.event)

    @property
    def source(self) -> dict | None:
        return frame_json(self.frame)

    @property
    def where(self) -> str:
        s = self.source
        mod = self.step.module_of(self.event)
        at = f"{s['file']}:{s['line']}" if s else "an unknown line"
        return f"{at} (module {mod if mod else '<root>'!r})"

    def chain_events(self) -> list[Event]:
        return [self.step.events[i] for i in self.chain]

    def rewrite(self, transform, call_name: str | None = None) -> codefix.Rewrite | None:
        s = self.source
        if not s:
            return None
        return codefix.rewrite(s["path"], s["line"], call_name or self.call_name, transform)


# ------------------------------------------------------------------ epsilon


def choose_eps(dtype: str, scale: float | None, what: str) -> tuple[float, str]:
    """The epsilon for this dtype and these values, with the reasoning behind it.

    eps = the largest power of ten not above finfo(dtype).eps * scale: adding it
    moves no value of magnitude `scale` by more than one rounding step of the
    dtype, so the result is unchanged where it was fine; yet it keeps `what`
    (e.g. "1/(2*sqrt(x+eps))") finite where the input was at the edge.
    """
    fi = torch.finfo(getattr(torch, dtype, torch.float32))
    s = scale if scale and math.isfinite(scale) and scale > 0 else 1.0
    raw = fi.eps * s
    eps = 10.0 ** math.floor(math.log10(raw))
    eps = max(eps, 10.0 ** math.ceil(math.log10(fi.tiny)))  # never below the smallest normal number
    eps = float(f"{eps:.0e}")  # a clean power of ten
    reasoning = (f"eps = {_fmt(eps)}: {dtype} resolves about {fi.eps:.1e} relative to the input's scale "
                 f"(|x| up to {s:.3g}), so adding it moves no value that was fine by more than one rounding step, "
                 f"while {what} stays finite")
    return eps, reasoning


def eps_candidates(eps: float) -> list[float]:
    """The chosen epsilon first, then larger ones in case the first does not verify."""
    return [eps, eps * 1e2, eps * 1e4]


def _fmt(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e+")


# ------------------------------------------------------------------ patches (call-site rewrites)


def _replace_arg(i: int, change: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    def fn(func, args, kwargs):
        args = list(args)
        args[i] = change(args[i])
        return func(*args, **kwargs)
    return fn


def _denominator_index(call_name: str) -> int:
    return 0 if call_name.rsplit(".", 1)[-1] in ("__rdiv__", "__rtruediv__") else 1


# ------------------------------------------------------------------ rules: log and friends

_LOGS = (aten.log, aten.log2, aten.log10)


def _log_family(s: Site) -> bool:
    return s.packet in ("aten.log", "aten.log2", "aten.log10") and s.call_is("log", "log2", "log10")


def _capture_then(calls: dict[int, str], final: int, make: Callable[[dict], Callable]) -> dict[int, Callable]:
    """Patches that remember the inputs of earlier calls (by name) and use them at the final call."""
    state: dict = {}
    patches: dict[int, Callable] = {}
    for call, key in calls.items():
        def grab(func, args, kwargs, key=key):
            out = func(*args, **kwargs)
            state[key] = (args, kwargs, out)
            return out
        patches[call] = grab
    patches[final] = lambda func, args, kwargs: make(state)(func, args, kwargs)
    return patches


def _softmax_dim(args, kwargs) -> int:
    return kwargs.get("dim", args[1] if len(args) > 1 else -1)


@rule("log_softmax", *_LOGS)
def _log_of_softmax(s: Site) -> Diagnosis | None:
    sm = s.src(0)
    if sm is None or packet(str(sm.op)) not in ("aten._softmax", "aten.softmax") or not _log_family(s):
        return None
    fixes = []
    if sm.call and s.call:
        def make(state):
            (args, kwargs, _) = state["softmax"]
            return lambda func, a, k: torch.log_softmax(args[0], dim=_softmax_dim(args, kwargs))
        patch = _capture_then({sm.call: "softmax"}, s.call, make)
    else:
        patch = None
    rw = s.rewrite(lambda src, node: _log_softmax_text(src, node))
    generic = "torch.log_softmax(logits, dim=-1)  # not torch.log(torch.softmax(logits, dim=-1))"
    fixes.append(Fix("log_softmax", rw.after if rw else generic,
                     before=rw.before if rw else None, after=rw.after if rw else None, patch=patch,
                     reasoning="log_softmax computes x - logsumexp(x) directly, so it never takes log(0)"))
    return Diagnosis(
        "log_softmax", "log(softmax(x)): softmax underflowed to 0 and log made it -inf",
        f"softmax returned exactly 0 for some entries (their logits were far below the row's maximum), "
        f"and log(0) = -inf {'in forward' if s.forward else 'gave 0/0 = NaN in its backward (grad / p)'}. "
        f"This is the seed's `log(softmax(x))` collapse at {s.where}.", fixes)


def _log_softmax_text(src, node) -> str | None:
    inner = codefix.operand(node, "input")
    if isinstance(inner, codefix.ast.Call):
        f = inner.func
        name = f.attr if isinstance(f, codefix.ast.Attribute) else getattr(f, "id", "")
        if name == "softmax":
            if codefix._is_function_call(inner):
                args = ", ".join(src(a) for a in inner.args) + "".join(f", {k.arg}={src(k.value)}" for k in inner.keywords)
            else:
                rest = [src(a) for a in inner.args] + [f"{k.arg}={src(k.value)}" for k in inner.keywords]
                args = ", ".join([src(f.value)] + rest)
            return f"torch.log_softmax({args})"
    return None


@rule("logsigmoid", *_LOGS)
def _log_of_sigmoid(s: Site) -> Diagnosis | None:
    sg = s.src(0)
    if sg is None or packet(str(sg.op)) != "aten.sigmoid" or not _log_family(s):
        return None
    patch = None
    if sg.call and s.call:
        patch = _capture_then({sg.call: "sig"}, s.call,
                              lambda st: lambda func, a, k: F.logsigmoid(st["sig"][0][0]))
    return Diagnosis(
        "logsigmoid", "log(sigmoid(x)): sigmoid saturated to 0 and log made it -inf",
        f"sigmoid(x) rounds to exactly 0 for very negative x, and log(0) = -inf at {s.where}.",
        [Fix("logsigmoid", "F.logsigmoid(x)  # instead of torch.log(torch.sigmoid(x))", patch=patch,
             reasoning="logsigmoid(x) = -softplus(-x) is exact for any x")])


@rule("bce_saturated", *_LOGS)
def _handwritten_bce(s: Site) -> Diagnosis | None:
    """log(1 - sigmoid(z)) (and log(sigmoid(z))) in a hand-written binary cross-entropy."""
    if not _log_family(s):
        return None
    r = s.src(0)
    if r is None or packet(str(r.op)) not in ("aten.rsub", "aten.sub"):
        return None
    sg = next((s.src(i, r) for i in range(len(r.src)) if s.src_packet(i, r) == "aten.sigmoid"), None)
    if sg is None:
        return None
    patch = None
    if sg.call and s.call:
        # rewrite every log over this sigmoid: log(p) -> logsigmoid(z), log(1-p) -> logsigmoid(-z)
        sig_idx = s.step.ops.index(sg)
        calls: dict[int, Callable] = {}
        state: dict = {}

        def grab(func, args, kwargs):
            out = func(*args, **kwargs)
            state["z"] = args[0]
            return out
        calls[sg.call] = grab
        for op in s.step.ops:
            if packet(str(op.op)) != "aten.log" or not op.call:
                continue
            if sig_idx in op.src:
                calls[op.call] = lambda func, a, k: F.logsigmoid(state["z"])
            elif any(j is not None and sig_idx in s.step.ops[j].src and
                     packet(str(s.step.ops[j].op)) in ("aten.rsub", "aten.sub") for j in op.src):
                calls[op.call] = lambda func, a, k: F.logsigmoid(-state["z"])
        patch = calls
    return Diagnosis(
        "bce_saturated", "hand-written binary cross-entropy on a saturated sigmoid",
        f"p = sigmoid(z) rounded to exactly 1 (or 0), so log(1 - p) (or log(p)) is log(0) = -inf at {s.where}. "
        "Computing BCE from probabilities loses everything beyond float precision; compute it from the logits.",
        [Fix("bce_with_logits", "loss = F.binary_cross_entropy_with_logits(z, y)  # z: the logits, before sigmoid",
             patch=patch, reasoning="the log-sum-exp form is exact for any logit")])


@rule("zero_times_log_zero", *_LOGS)
def _zero_log_zero(s: Site) -> Diagnosis | None:
    """p * log(p) with p == 0: log gives -inf, the product 0 * -inf = NaN."""
    if not (s.forward and s.event.kind == "inf" and _log_family(s)):
        return None
    mul = next((i for i in s.consumers() if packet(str(s.step.ops[i].op)) == "aten.mul"), None)
    conv = [e for e in s.chain_events() if e.role == "conversion" and e.fwd == mul]
    if mul is None or not conv:
        return None
    mrec = s.step.ops[mul]
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
        fixes.append(Fix("xlogy", "torch.special.xlogy(p, p)  # = p * log(p), defined as 0 where p == 0",
                         patch={s.call: grab_log, mrec.call: xlogy},
                         reasoning="xlogy(x, y) = x*log(y) with 0 where x == 0 — but its gradient with respect "
                                   "to y is x/y, still 0/0 = NaN at p == 0"))
    for e in eps_candidates(eps):
        rw = s.rewrite(codefix.with_operand("input", lambda t, e=e: f"{codefix.paren(t)}.clamp_min({_fmt(e)})"))
        fixes.append(Fix("clamp", rw.after if rw else f"p * torch.log(p.clamp_min({_fmt(e)}))", epsilon=e,
                         before=rw.before if rw else None, after=rw.after if rw else None,
                         patch={s.call: _replace_arg(0, lambda t, e=e: t.clamp_min(e))} if s.call else None,
                         reasoning=f"clamping inside the log keeps p*log(p) = 0 at p = 0 with finite gradients; {why}"))
    return Diagnosis(
        "zero_times_log_zero", "0 * log(0): an entropy-style term p*log(p) at p = 0",
        f"p held exact zeros, log(p) = -inf at {s.where}, and the product 0 * -inf is NaN. "
        "Mathematically the term is 0 there; numerically it is NaN.", fixes)


# ------------------------------------------------------------------ the where trap

_DOMAIN = {  # op -> (which input is unsafe, safe-mask builder, a safe value, readable condition)
    "aten.log": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.log2": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.log10": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.sqrt": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.rsqrt": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.pow": (0, lambda x: x > 0, 1.0, "x > 0"),
    "aten.reciprocal": (0, lambda x: x != 0, 1.0, "x != 0"),
    "aten.acos": (0, lambda x: x.abs() < 1, 0.0, "x.abs() < 1"),
    "aten.asin": (0, lambda x: x.abs() < 1, 0.0, "x.abs() < 1"),
    "aten.div": (1, lambda x: x != 0, 1.0, "y != 0"),
}


@rule("where_trap", *(getattr(aten, p.split(".")[1]) for p in _DOMAIN))
def _where_trap(s: Site) -> Diagnosis | None:
    if s.packet not in _DOMAIN or s.event.fwd is None:
        return None
    if "aten.where" not in s.consumer_packets():
        return None
    failure = s.step.failure
    if failure is None or failure.what != "gradient":
        return None
    idx, ok, safe, cond = _DOMAIN[s.packet]
    if s.packet == "aten.div":
        idx = _denominator_index(s.call_name)
    fn_name = s.call_name.rsplit(".", 1)[-1] or s.packet.split(".")[1]
    patch = {s.call: _replace_arg(idx, lambda t: torch.where(ok(t), t, torch.full_like(t, safe)))} if s.call else None
    var = "y" if s.packet == "aten.div" else "x"
    rw = s.rewrite(codefix.with_operand("other" if s.packet == "aten.div" else "input",
                                        lambda t: f"torch.where({cond.replace(var, codefix.paren(t))}, {t}, {safe})"))
    return Diagnosis(
        "where_trap", f"the torch.where trap: {fn_name} outside its domain on the branch where() discards",
        f"torch.where(cond, {fn_name}(x), other) computed {fn_name} on every element, including those where cond "
        f"is False. Forward discards them, but backward multiplies their gradient (0) by {fn_name}'s derivative "
        f"there (Inf or NaN), and 0 * Inf = NaN reaches the gradients ({s.where}). The fix is the double where: "
        f"make the input safe *before* the op, so the discarded branch is finite too.",
        [Fix("double_where", rw.after if rw else f"torch.where(cond, {fn_name}(torch.where({cond}, x, {safe})), other)",
             before=rw.before if rw else None, after=rw.after if rw else None, patch=patch,
             reasoning="the inner where feeds the op only values where it is defined; the outer where "
                       "keeps the result exactly as before")])


# ------------------------------------------------------------------ log / sqrt / pow / acos at the domain edge


def _edge_fix(s: Site, kind: str, scale: float | None, what: str, change_code: Callable[[str, float], str],
              change: Callable[[torch.Tensor, float], torch.Tensor], generic: Callable[[float], str],
              which: str = "input", arg: int = 0) -> list[Fix]:
    eps, why = choose_eps(s.dtype, scale, what)
    fixes = []
    for e in eps_candidates(eps):
        rw = s.rewrite(codefix.with_operand(which, lambda t, e=e: change_code(t, e)))
        fixes.append(Fix(kind, rw.after if rw else generic(e), epsilon=e, reasoning=why,
                         before=rw.before if rw else None, after=rw.after if rw else None,
                         patch={s.call: _replace_arg(arg, lambda t, e=e: change(t, e))} if s.call else None))
    return fixes


@rule("log_of_zero", *_LOGS)
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
    fixes = _edge_fix(s, "epsilon", x.get("absmax"), "log(x + eps) and its gradient 1/(x + eps)",
                      lambda t, e: f"{codefix.paren(t)} + {_fmt(e)}",
                      lambda t, e: t + e, lambda e: f"torch.log(p + {_fmt(e)})")
    what = "-inf in forward" if s.forward else "0/0 = NaN in its backward (grad / x with x = 0)"
    return Diagnosis("log_of_zero", "log of zero",
                     f"log received exact zeros ({x.get('zeros', '?')} of them) at {s.where}: log(0) = -inf, "
                     f"and here that became {what}.", fixes)


@rule("log_of_negative", *_LOGS)
def _log_negative(s: Site) -> Diagnosis | None:
    x = s.inp(0)
    if not (s.forward and _log_family(s) and x.get("negatives", 0)):
        return None
    fixes = _edge_fix(s, "clamp", x.get("absmax"), "log(x.clamp_min(eps))",
                      lambda t, e: f"{codefix.paren(t)}.clamp_min({_fmt(e)})",
                      lambda t, e: t.clamp_min(e), lambda e: f"torch.log(x.clamp_min({_fmt(e)}))")
    return Diagnosis("log_of_negative", "log of a negative number",
                     f"log received {x['negatives']} negative values (min {x.get('min')}) at {s.where}: log(x<0) = "
                     "NaN. Check why the input can be negative; clamp it if that is expected.", fixes)


def _sqrt_call(s: Site) -> bool:
    return s.packet == "aten.sqrt" and s.call_is("sqrt")


@rule("sqrt_cancellation", aten.sqrt)
def _sqrt_cancel(s: Site) -> Diagnosis | None:
    """sqrt(E[x^2] - E[x]^2): rounding makes a zero variance slightly negative."""
    x = s.inp(0)
    if not (s.forward and _sqrt_call(s) and x.get("negatives", 0)) or s.src_packet(0) != "aten.sub":
        return None
    fixes = _edge_fix(s, "clamp", x.get("absmax"), "sqrt and its gradient",
                      lambda t, e: f"{codefix.paren(t)}.clamp_min(0) + {_fmt(e)}",
                      lambda t, e: t.clamp_min(0) + e, lambda e: f"torch.sqrt(var.clamp_min(0) + {_fmt(e)})")
    return Diagnosis("sqrt_cancellation", "sqrt of a variance computed as E[x²] − E[x]²",
                     f"sqrt's input is a difference (min {x.get('min')}): computed as E[x²] − E[x]², rounding makes "
                     f"a zero variance slightly negative, and sqrt of a negative is NaN at {s.where}. Clamp at 0 then "
                     "add eps, or use torch.var(x, correction=0), which does not cancel.", fixes)


@rule("sqrt_of_negative", aten.sqrt)
def _sqrt_negative(s: Site) -> Diagnosis | None:
    x = s.inp(0)
    if not (s.forward and _sqrt_call(s) and x.get("negatives", 0)):
        return None
    fixes = _edge_fix(s, "clamp", x.get("absmax"), "sqrt and its gradient",
                      lambda t, e: f"{codefix.paren(t)}.clamp_min(0) + {_fmt(e)}",
                      lambda t, e: t.clamp_min(0) + e, lambda e: f"torch.sqrt(x.clamp_min(0) + {_fmt(e)})")
    return Diagnosis("sqrt_of_negative", "sqrt of a negative number",
                     f"sqrt received {x['negatives']} negative values (min {x.get('min')}) at {s.where}: "
                     "sqrt(x<0) = NaN in forward, and anomaly mode would flag its backward.", fixes)


@rule("sqrt_at_zero", aten.sqrt)
def _sqrt_zero(s: Site) -> Diagnosis | None:
    if not _sqrt_call(s) or s.forward or s.event.node != "SqrtBackward0":
        return None
    denom = s.inp(1)  # SqrtBackward0: grad / (2 * sqrt(x))
    amax = denom.get("absmax")
    scale = (amax / 2) ** 2 if isinstance(amax, (int, float)) else None
    fixes = _edge_fix(s, "epsilon", scale, "the gradient 1/(2*sqrt(x + eps))",
                      lambda t, e: f"{codefix.paren(t)} + {_fmt(e)}", lambda t, e: t + e,
                      lambda e: f"torch.sqrt(x + {_fmt(e)})")
    return Diagnosis("sqrt_at_zero", "sqrt at zero: infinite gradient",
                     f"sqrt's input held exact zeros at {s.where}. sqrt(0) = 0 is fine in forward, but its "
                     "derivative 1/(2*sqrt(x)) is Inf there — the seed's `sqrt(0).backward()` case (often a "
                     "distance or norm between identical vectors).", fixes)


@rule("pow_of_negative", aten.pow)
def _pow_negative(s: Site) -> Diagnosis | None:
    x = s.inp(0)
    a = next((v for v in s.event.scalars or [] if isinstance(v, float)), None)
    if not (s.forward and s.call_is("pow", "__pow__") and x.get("negatives", 0) and a is not None and a != int(a)):
        return None
    fixes = _edge_fix(s, "clamp", x.get("absmax"), f"x ** {a} and its gradient",
                      lambda t, e: f"{codefix.paren(t)}.clamp_min({_fmt(e)})", lambda t, e: t.clamp_min(e),
                      lambda e: f"x.clamp_min({_fmt(e)}) ** {a}")
    return Diagnosis("pow_of_negative", f"fractional power ({a}) of a negative number",
                     f"x ** {a} is NaN for x < 0 ({x['negatives']} such values) at {s.where}.", fixes)


@rule("pow_at_zero", aten.pow)
def _pow_zero(s: Site) -> Diagnosis | None:
    if not s.call_is("pow", "__pow__") or s.forward or s.event.node != "PowBackward0":
        return None
    x = s.inp(0)
    fixes = _edge_fix(s, "epsilon", x.get("absmax"), "the gradient a * (x + eps) ** (a - 1)",
                      lambda t, e: f"{codefix.paren(t)} + {_fmt(e)}", lambda t, e: t + e,
                      lambda e: f"(x + {_fmt(e)}) ** a")
    return Diagnosis("pow_at_zero", "x ** a with a < 1 at x = 0: infinite gradient",
                     f"the derivative a * x**(a-1) has a negative power, so it is Inf at x = 0 ({s.where}).", fixes)


@rule("acos_asin_boundary", aten.acos, aten.asin)
def _acos(s: Site) -> Diagnosis | None:
    name = s.packet.split(".")[1]
    if not s.call_is(name, "arccos", "arcsin"):
        return None
    x = s.inp(0)
    eps = 10.0 ** math.ceil(math.log10(s.finfo.eps * 8))
    lo, hi = f"-1 + {_fmt(eps)}", f"1 - {_fmt(eps)}"
    fixes = []
    for e in (eps, eps * 10, eps * 100):
        rw = s.rewrite(codefix.with_operand("input", lambda t, e=e: f"{codefix.paren(t)}.clamp(-1 + {_fmt(e)}, 1 - {_fmt(e)})"))
        fixes.append(Fix("clamp", rw.after if rw else f"torch.{name}(x.clamp({lo}, {hi}))", epsilon=e,
                         before=rw.before if rw else None, after=rw.after if rw else None,
                         patch={s.call: _replace_arg(0, lambda t, e=e: t.clamp(-1 + e, 1 - e))} if s.call else None,
                         reasoning=f"the derivative ∓1/sqrt(1 - x²) is Inf at |x| = 1; {e:.0e} is a few "
                                   f"{s.dtype} rounding steps inside the boundary"))
    inside = "outside [-1, 1] (NaN in forward)" if s.forward else "exactly ±1 (Inf in the derivative)"
    return Diagnosis("acos_asin_boundary", f"{name} at the edge of its domain",
                     f"{name} received values {inside} at {s.where} — typically a cosine similarity that rounding "
                     f"pushed to 1.0000001 (x range seen: {x.get('min')} .. {x.get('max')}).", fixes)


# ------------------------------------------------------------------ division, normalisation, std


@rule("std_single_element", aten.std, aten.var)
def _std_one(s: Site) -> Diagnosis | None:
    if not (s.forward and s.call_is("std", "var")):
        return None

    def fn(func, args, kwargs):
        kw = {k: v for k, v in kwargs.items() if k not in ("unbiased", "correction")}
        a = [x for x in args if not isinstance(x, bool)]
        return func(*a, **kw, correction=0)
    return Diagnosis("std_single_element", "unbiased std/var over a single element",
                     f"{s.call_name}() uses Bessel's correction (divide by n - 1); over one element that is 0/0 = NaN "
                     f"({s.where}). A batch or group of size 1 does this.",
                     [Fix("correction", f"{s.call_name.split('.')[0].replace('Tensor', 'x')}."
                          f"{s.call_name.rsplit('.', 1)[-1]}(..., correction=0)  # or guard groups of size 1",
                          patch={s.call: fn} if s.call else None,
                          reasoning="correction=0 (the population std) is defined for n = 1")])


@rule("empty_reduction", aten.nll_loss_forward, aten.nll_loss2d_forward, aten.mean)
def _empty_reduction(s: Site) -> Diagnosis | None:
    if not s.forward or s.event.kind != "nan" or s.event.role != "origin":
        return None
    if s.packet == "aten.mean":
        x = s.inp(0)
        if x.get("shape") is None or math.prod(x["shape"]) != 0:
            return None
        fix = Fix("guard_empty_reduction", "x.sum() / max(x.numel(), 1)  # mean of an empty tensor is NaN",
                  patch={s.call: lambda func, a, k: a[0].sum() * 0.0} if s.call else None,
                  reasoning="an empty selection contributes 0 instead of 0/0")
        return Diagnosis("empty_reduction", "mean over zero elements",
                         f"mean() of an empty tensor is 0/0 = NaN ({s.where}): a mask or filter selected nothing.",
                         [fix])
    target = next((st for st in s.inputs if st.get("dtype", "").startswith("int")), None)
    ignore = next((v for v in (s.event.scalars or []) if isinstance(v, int) and v < 0), -100)
    if target is None:
        return None

    def guarded(func, args, kwargs):
        tgt = args[1] if len(args) > 1 else kwargs["target"]
        ii = kwargs.get("ignore_index", -100)
        n = (tgt != ii).sum()
        kw = {**kwargs, "reduction": "sum"}
        return func(*args, **kw) / n.clamp_min(1)
    fix = Fix("guard_empty_reduction",
              f"n = (y != {ignore}).sum()\nloss = F.cross_entropy(logits, y, ignore_index={ignore}, "
              "reduction='sum') / n.clamp_min(1)",
              patch={s.call: guarded} if s.call and s.call_is("cross_entropy", "nll_loss") else None,
              reasoning="a batch whose targets are all ignored contributes 0 instead of 0/0")
    return Diagnosis("empty_reduction", "cross-entropy mean over zero targets (all ignore_index)",
                     f"every target in the batch equals ignore_index ({ignore}), so reduction='mean' divides 0 "
                     f"by 0 ({s.where}). Common with padding-only or fully masked batches.", [fix])


_NORMS = ("aten.linalg_vector_norm", "aten.norm", "aten.sqrt", "aten.std", "aten.var", "aten.sum", "aten.abs")


@rule("normalize_zero_norm", aten.div)
def _normalize(s: Site) -> Diagnosis | None:
    if not (s.forward and s.op_packet == "aten.div" and s.call_is("div", "__truediv__", "true_divide", "__rdiv__")):
        return None
    idx = _denominator_index(s.call_name)
    d = s.inp(idx)
    prod = s.src_packet(idx)
    if not d.get("zeros") or prod not in _NORMS:
        return None
    is_std = prod in ("aten.std", "aten.var", "aten.sqrt")
    label = "standard deviation" if is_std else "norm"
    fixes = _edge_fix(s, "epsilon", s.inp(1 - idx).get("absmax") if len(s.inputs) > 1 else None,
                      f"x / ({label} + eps) and its gradient",
                      lambda t, e: f"{codefix.paren(t)}.clamp_min({_fmt(e)})", lambda t, e: t.clamp_min(e),
                      lambda e: f"x / x.norm(dim=-1, keepdim=True).clamp_min({_fmt(e)})  "
                                f"# or F.normalize(x, dim=-1, eps={_fmt(e)})",
                      which="other", arg=idx)
    what = ("(x - mean) / std with a constant feature or group (std = 0)" if is_std
            else "x / x.norm() with an all-zero vector (norm = 0)")
    return Diagnosis("normalize_zero_norm", f"division by a zero {label}",
                     f"{what}: {d['zeros']} zero denominators at {s.where}, giving 0/0 = NaN.", fixes)


@rule("division_by_zero", aten.div, aten.reciprocal, aten.rsqrt)
def _div_zero(s: Site) -> Diagnosis | None:
    if s.op_packet not in ("aten.div", "aten.reciprocal", "aten.rsqrt") or not s.forward:
        return None
    if s.op_packet == "aten.div":
        if not s.call_is("div", "__truediv__", "true_divide", "__rdiv__"):
            return None
        idx, which = _denominator_index(s.call_name), "other"
    else:
        idx, which = 0, "input"
    d = s.inp(idx)
    if not d.get("zeros"):
        return None
    num = s.inp(1 - idx) if s.op_packet == "aten.div" and len(s.inputs) > 1 else {}
    zero_zero = s.event.kind == "nan"
    if d.get("negatives"):
        code, change = (lambda t, e: f"{codefix.paren(t)} + {_fmt(e)}"), (lambda t, e: t + e)
    else:
        code, change = (lambda t, e: f"{codefix.paren(t)}.clamp_min({_fmt(e)})"), (lambda t, e: t.clamp_min(e))
    fixes = _edge_fix(s, "epsilon", d.get("absmax") or num.get("absmax"), "the quotient and its gradient",
                      code, change, lambda e: f"x / y.clamp_min({_fmt(e)})", which=which, arg=idx)
    return Diagnosis("division_by_zero", "0/0" if zero_zero else "division by zero",
                     f"the denominator held {d['zeros']} exact zeros at {s.where}: "
                     f"{'0/0 = NaN' if zero_zero else 'x/0 = Inf'}.", fixes)


# ------------------------------------------------------------------ exp, softmax, masks


@rule("handwritten_softmax", aten.exp)
def _handwritten_softmax(s: Site) -> Diagnosis | None:
    if not (s.forward and s.call_is("exp")):
        return None
    cons = s.consumer_packets()
    if not any(p in ("aten.sum", "aten.div") for p in cons):
        return None
    sum_rec = next((s.step.ops[i] for i in s.consumers() if packet(str(s.step.ops[i].op)) == "aten.sum"), None)
    log_after = sum_rec is not None and any(packet(str(s.step.ops[j].op)) == "aten.log"
                                            for j in s.consumers(s.step.ops.index(sum_rec)))
    x = s.inp(0)

    def fn(func, args, kwargs):
        t = args[0]
        return func(t - t.detach().amax(dim=-1, keepdim=True), *args[1:], **kwargs)
    rw = s.rewrite(codefix.with_operand("input", lambda t: f"{codefix.paren(t)} - {codefix.paren(t)}.amax(dim=-1, keepdim=True)"))
    if log_after:
        code, title = "torch.logsumexp(x, dim=-1)  # not torch.log(torch.exp(x).sum(-1))", "hand-written logsumexp overflowed"
    else:
        code, title = "torch.softmax(x, dim=-1)  # not x.exp() / x.exp().sum(-1, keepdim=True)", "hand-written softmax overflowed"
    lim = math.log(torch.finfo(getattr(torch, s.dtype)).max)
    return Diagnosis("handwritten_softmax", title,
                     f"exp overflowed to Inf for inputs above {lim:.1f} ({s.dtype}; max seen {x.get('max')}) at "
                     f"{s.where}, then the normalisation made Inf/Inf = NaN. Subtracting the row maximum first "
                     "(what torch.softmax and torch.logsumexp do) keeps exp ≤ 1.",
                     [Fix("max_subtraction", rw.after if rw else code, before=rw.before if rw else None,
                          after=rw.after if rw else None, patch={s.call: fn} if s.call else None,
                          reasoning=f"{code.split('#')[0].strip()} is the stable form; exp(x - max) never overflows")])


@rule("exp_overflow", aten.exp)
def _exp_overflow(s: Site) -> Diagnosis | None:
    if not (s.forward and s.call_is("exp") and s.event.kind == "inf"):
        return None
    x = s.inp(0)
    lim = math.floor(math.log(s.finfo.max)) - 1
    fixes = []
    rw = s.rewrite(codefix.with_operand("input", lambda t: f"{codefix.paren(t)}.clamp(max={lim})"))
    fixes.append(Fix("clamp", rw.after if rw else f"torch.exp(x.clamp(max={lim}))", before=rw.before if rw else None,
                     after=rw.after if rw else None,
                     patch={s.call: _replace_arg(0, lambda t: t.clamp(max=lim))} if s.call else None,
                     reasoning=f"exp(x) overflows {s.dtype} above x ≈ {math.log(s.finfo.max):.1f}"))
    return Diagnosis("exp_overflow", "exp overflow",
                     f"exp received values up to {x.get('max')} at {s.where}; in {s.dtype} exp overflows above "
                     f"{math.log(s.finfo.max):.1f}. If this is a softmax or logsumexp, use the library function; "
                     "otherwise clamp the input or work in log space.", fixes)


@rule("softmax_all_masked", aten._softmax, aten._log_softmax)
def _masked_row(s: Site) -> Diagnosis | None:
    if not (s.forward and s.event.role == "conversion"):
        return None
    lit = next((e for e in s.chain_events() if e.role == "literal" and e.index < s.event.index), None)
    patch, rw = None, None
    if lit is not None and lit.fwd is not None and s.step.ops[lit.fwd].call:
        lrec = s.step.ops[lit.fwd]

        def finite_mask(func, args, kwargs):
            ref = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            dt = ref.dtype if ref is not None else torch.float32
            lo = torch.finfo(dt).min

            def sub(a):
                if isinstance(a, float) and math.isinf(a) and a < 0:
                    return lo
                if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() == 0 and bool(torch.isneginf(a)):
                    return torch.tensor(lo, dtype=a.dtype, device=a.device)
                return a
            return func(*[sub(a) for a in args], **{k: sub(v) for k, v in kwargs.items()})
        patch = {lrec.call: finite_mask}
        fr = frame_json(lrec.frame)
        if fr:
            text = codefix.linecache.getline(fr["path"], fr["line"]).strip()
            for pat in ("float('-inf')", 'float("-inf")', "-float('inf')", '-float("inf")', "-math.inf",
                        "-torch.inf", "float('-Inf')", "-np.inf"):
                if pat in text:
                    rw = codefix.Rewrite(text, text.replace(pat, "torch.finfo(scores.dtype).min"), fr["line"])
                    break
    code = rw.after if rw else "scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)  # not float('-inf')"
    return Diagnosis("softmax_all_masked", "softmax over a fully masked row",
                     f"every entry of some softmax row was -inf (a mask with no allowed position, e.g. an all-padding "
                     f"sequence), so softmax computed exp(-inf - (-inf)) = NaN at {s.where}. A healthy causal mask is "
                     "fine; an empty row is not. Use the dtype's most negative finite value as the mask value "
                     "(the row then becomes uniform, and you can zero it), or drop empty rows.",
                     [Fix("finite_mask_value", code, before=rw.before if rw else None, after=rw.after if rw else None,
                          patch=patch, reasoning="finfo(dtype).min behaves like -inf for every row that has an "
                          "allowed position, and keeps fully masked rows finite")])


# ------------------------------------------------------------------ precision and exploded weights

def _low_precision(s: Site) -> bool:
    return s.dtype in ("float16", "bfloat16") or bool(s.subject.autocast)


@rule("fp16_overflow")
def _fp16(s: Site) -> Diagnosis | None:
    if not _low_precision(s) or s.event.role != "origin" or s.event.kind != "inf":
        return None
    big = max((st.get("absmax") or 0 for st in s.inputs if isinstance(st.get("absmax"), (int, float))), default=0)
    fmax = torch.finfo(torch.float16).max
    auto = s.subject.autocast
    if auto:
        code = ("with torch.autocast(device_type, dtype=torch.bfloat16):  # instead of float16\n"
                "    loss = ...\n# or keep float16 and scale the loss: scaler = torch.amp.GradScaler()")
        variant = {"autocast": {**auto, "dtype": torch.bfloat16}, "label": "under bfloat16 autocast"}
    else:
        code = ("model = model.to(torch.bfloat16)  # same range as float32\n"
                "# or train in float32 with torch.autocast(..., dtype=torch.float16) and torch.amp.GradScaler()")
        variant = {"dtype": torch.bfloat16, "label": "in bfloat16"}
    return Diagnosis("fp16_overflow", "float16 overflow",
                     f"{s.event.op} produced Inf from finite inputs (|x| up to {big:.4g}) in float16, whose largest "
                     f"value is {fmax:.0f} ({s.where}). The same op is finite in a wider dtype. bfloat16 has float32's "
                     "range; in backward, a GradScaler keeps scaled gradients in range and skips the step on overflow.",
                     [Fix("bf16_or_grad_scaler", code, variant=variant,
                          reasoning="bfloat16 trades mantissa bits for float32's exponent range")])


@rule("exploded_weights")
def _exploded(s: Site) -> Diagnosis | None:
    if s.event.role != "origin" or s.event.kind != "inf":
        return None
    fmax = s.finfo.max
    big = [(n, float(p.detach().abs().max())) for n, p in s.subject.model.named_parameters()
           if p.is_floating_point() and p.numel()]
    huge = [(n, v) for n, v in big if v > min(1e5, math.sqrt(fmax) / 16)]
    if not huge:
        return None
    huge.sort(key=lambda nv: -nv[1])
    names = ", ".join(f"{n} (max |w| {v:.3g})" for n, v in huge[:3])
    return Diagnosis("exploded_weights", "weights already exploded",
                     f"{s.event.op} overflowed at {s.where} because the parameters are already huge: {names}. The "
                     "step itself is not the bug — earlier steps grew the weights. Lower the learning rate, clip "
                     "gradients, and restore the last good checkpoint.",
                     [Fix("lower_lr_clip_grads",
                          "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
                          "# and: lower the learning rate; restore the last checkpoint with finite, sane weights")])


@rule("unrecognised")
def _generic(s: Site) -> Diagnosis:
    op = s.event.op
    what = {"origin": "computed a non-finite value from finite inputs",
            "conversion": "turned Inf into NaN (inf - inf, 0 * inf, or a fully -inf softmax row)",
            "literal": "holds a non-finite constant from its arguments"}.get(s.event.role, "propagated a non-finite value")
    phase = (f"in backward ({s.event.node}, the gradient of {s.fwd_op})" if not s.forward else "in forward")
    return Diagnosis("unrecognised", f"{op} {what}",
                     f"{op} {what} {phase} at {s.where}. nanreplay has no specific rule for this pattern; the inputs "
                     "table shows what the op saw.", [Fix("none", "# no automatic suggestion for this pattern")])


# ------------------------------------------------------------------ entry points


def diagnose(result, subject, step: Step, c: int | None, *, verify_fixes: bool = True) -> dict:
    """The `diagnosis` object of the JSON contract, with fixes verified by replay."""
    if c is None:
        return _not_reproduced(result, subject)
    from nanreplay.culprit import chain

    site = Site(step, step.events[c], chain(step.events, step.failure.event if step.failure else None), subject)
    diag = None
    for r in RULES:
        if r.ops and site.packet not in r.ops and site.op_packet not in r.ops:
            continue
        diag = r.fn(site)
        if diag is not None:
            if diag.cause != r.cause:
                raise RuntimeError(f"rule {r.cause!r} returned cause {diag.cause!r}")
            break
    assert diag is not None  # the generic rule always answers
    chosen, tried = _verify(diag, subject) if verify_fixes else (diag.fixes[0], [])
    out = {
        "cause": diag.cause,
        "title": diag.title,
        "explanation": diag.explanation + " " + anomaly_sentence(result.anomaly_mode, site),
        "fix": chosen.to_json(),
        "candidates": [f.to_json() for f in tried],
    }
    return out


def _verify(diag: Diagnosis, subject) -> tuple[Fix, list[Fix]]:
    """Try each candidate fix in order; the first that verifies wins, else the first."""
    tried = []
    for fix in diag.fixes:
        if fix.patch:
            o = verify.try_patch(subject, fix.patch)
        elif fix.variant:
            v = fix.variant
            o = verify.try_variant(subject, dtype=v.get("dtype"), autocast=v.get("autocast", "same"),
                                   label=v.get("label", ""))
        else:
            fix.verification = "not a code change at the culprit site: nothing to replay"
            tried.append(fix)
            continue
        fix.verified, fix.verification = o.ok, o.detail
        tried.append(fix)
        if o.ok:
            return fix, tried
    code_fixes = [f for f in tried if f.verified is not None]
    if not code_fixes and diag.fixes and diag.fixes[0].kind not in ("none", "lower_lr_clip_grads"):
        diag.fixes[0].verification = ("could not apply this fix automatically at the culprit call "
                                      "(the call is not spelled as expected); not verified")
    return (code_fixes[0] if code_fixes else diag.fixes[0]), tried


def anomaly_sentence(anomaly: dict, site: Site | None) -> str:
    if anomaly.get("raises") is None:
        return ""
    if not anomaly["raises"]:
        kind = site.event.kind if site else "inf"
        if kind == "inf":
            return ("torch.autograd.set_detect_anomaly(True) would have stayed silent: it only checks backward "
                    "outputs for NaN, and this failure is Inf.")
        return "torch.autograd.set_detect_anomaly(True) would not have raised on this step."
    node = anomaly["node"]
    if anomaly.get("agrees_with_culprit"):
        return f"set_detect_anomaly(True) would have raised at {node}, which is this culprit's node."
    return (f"set_detect_anomaly(True) would have raised at {node} — later than the culprit: the value was already "
            f"{site.event.kind.upper() if site else 'non-finite'} before anomaly mode (which looks only for NaN in "
            "backward) noticed.")


def _not_reproduced(result, subject) -> dict:
    return {"cause": "not_reproduced", "title": "the replay is finite",
            "explanation": "Replaying the snapshot's step gave a finite loss and finite gradients everywhere. "
                           "Either the failure depends on state the snapshot does not hold (RNG for dropout, "
                           "nondeterministic kernels, a different device or dtype), or it happened in a later "
                           "step (e.g. the optimizer update). nanreplay does not invent a culprit.",
            "fix": Fix("none", "# nothing to fix in this step").to_json(), "candidates": []}


def for_leaves(verdict: str, rows: list[dict], snap) -> dict:
    """Diagnosis when NaN/Inf was already in the batch or the weights: nothing to replay."""
    names = ", ".join(f"{r['name']} ({r['nan']} NaN, {r['inf']} Inf)" for r in rows[:5])
    if verdict == "nonfinite_input":
        samples = sorted({i for r in rows for i in r.get("samples", [])})
        at = f" Bad samples (index along dim 0): {samples[:20]}." if samples else ""
        return {"cause": "nonfinite_input", "title": "NaN/Inf in the input batch",
                "explanation": f"The batch already holds non-finite values before the model runs: {names}.{at} "
                               "The model is not the culprit; the data pipeline is (a log of 0 or a division by 0 "
                               "in preprocessing, a corrupt record, a missing value read as NaN).",
                "fix": Fix("clean_input", "assert torch.isfinite(x).all(), f'non-finite input in batch {step}'\n"
                           "# find the source in the data pipeline; as a stopgap: x = torch.nan_to_num(x)",
                           verification="the batch itself is non-finite: nothing in the model to replay").to_json(),
                "candidates": []}
    return {"cause": "nonfinite_parameters", "title": "the weights were already non-finite",
            "explanation": f"Parameters or buffers hold NaN/Inf before this step runs: {names}. An earlier step "
                           "already diverged (its update wrote NaN/Inf into the weights) and this snapshot was taken "
                           "too late. Restore the last good checkpoint, lower the learning rate and clip gradients; "
                           "capture with nanreplay.NanGuard so the first bad step is saved before the optimizer "
                           "step.",
            "fix": Fix("restore_parameters", "model.load_state_dict(torch.load('last_good.pt'))\n"
                       "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # and a lower LR",
                       verification="the weights are already non-finite: nothing in this step to replay").to_json(),
            "candidates": []}
