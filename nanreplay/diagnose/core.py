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
from dataclasses import InitVar, dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from nanreplay import torch_internals as ti
from nanreplay import verify
from nanreplay.diagnose import codefix
from nanreplay.replay import Event, OpRecord, Step, frame_json

aten = torch.ops.aten

FIX_KINDS = ("epsilon", "clamp", "log_softmax", "logsigmoid", "xlogy", "bce_with_logits", "max_subtraction",
             "finite_mask_value", "double_where", "correction", "bf16_or_grad_scaler", "lower_lr_clip_grads",
             "clean_input", "restore_parameters", "guard_empty_reduction", "none")


@dataclass
class Fix:
    kind: str
    code: str  # the change, as code for this site (a generic snippet where the source is not known)
    epsilon: float | None = None
    reasoning: str = ""
    before: str | None = None  # the user's statement as written (when the source is readable)
    after: str | None = None
    patch: dict[int, Callable] | None = None  # call number -> rewrite, for verification
    variant: dict | None = None  # a whole-step change for verification (dtype / autocast)
    verified: bool | None = None
    verification: str | None = None
    rewrite: InitVar[codefix.Rewrite | None] = None  # the user's line rewritten: becomes code/before/after

    def __post_init__(self, rewrite: codefix.Rewrite | None) -> None:
        if self.kind not in FIX_KINDS:
            raise ValueError(f"unknown fix kind {self.kind!r}")
        if rewrite is not None:
            self.code, self.before, self.after = rewrite.after, rewrite.before, rewrite.after

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
        if not isinstance(op, ti.OpOverloadPacket):
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


_COPIES = ("aten.clone", "aten.contiguous", "aten.alias", "aten._to_copy", "aten.lift_fresh")


def _passes_through(rec: OpRecord) -> bool:
    """A view or a plain copy: same values, so rules look through it to the op that computed them."""
    return bool(getattr(rec.op, "is_view", False)) or packet(str(rec.op)) in _COPIES


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
        return self.step.call_of(self.event)

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

    def origin(self, i: int, rec: OpRecord | None = None) -> OpRecord | None:
        """Like src(), looking through views and copies (squeeze, view, clone, ...) to the op that computed it."""
        r = self.src(i, rec)
        while r is not None and _passes_through(r) and r.src:
            r = self.src(0, r)
        return r

    def origin_packet(self, i: int, rec: OpRecord | None = None) -> str | None:
        r = self.origin(i, rec)
        return packet(str(r.op)) if r else None

    def index(self, rec: OpRecord) -> int:
        return next(i for i, r in enumerate(self.step.ops) if r is rec)

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
        at = f"{s['file']}:{s['line']}" if s else f"{self.call_name or self.event.op} (no source line)"
        return f"{at} (module {mod if mod else '<root>'!r})"

    def chain_events(self) -> list[Event]:
        return [self.step.events[i] for i in self.chain]

    def rewrite(self, transform, call_name: str | None = None, line: int | None = None) -> codefix.Rewrite | None:
        """Rewrite the culprit call (or `call_name` on `line`) in the user's source, if it can be read."""
        s = self.source
        if not s:
            return None
        return codefix.rewrite(s["path"], line or s["line"], call_name or self.call_name, transform)


# ------------------------------------------------------------------ epsilon


def choose_eps(dtype: str, scale: float | None, what: str, *, floor: float | None = None,
               floor_why: str = "") -> tuple[float, str]:
    """The epsilon for this dtype and these values, with the reasoning behind it.

    eps = the largest power of ten not above finfo(dtype).eps * scale: adding it
    moves no value of magnitude `scale` by more than one rounding step of the
    dtype, so the result is unchanged where it was fine; yet it keeps `what`
    (e.g. "1/(2*sqrt(x+eps))") finite where the input was at the edge.

    `floor` is the smallest eps that keeps `what` finite in this dtype (e.g. a
    quotient's gradient x/eps² must stay below finfo.max); where the scale-based
    eps is below it, the floor wins (rounded up to a power of ten) and the
    reasoning says so. Nothing goes below the dtype's smallest normal number.
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
    if floor is not None and math.isfinite(floor) and floor > eps:
        low = eps
        eps = float(f"{10.0 ** math.ceil(math.log10(floor)):.0e}")
        reasoning = (f"eps = {_fmt(eps)}: {dtype} resolves about {fi.eps:.1e} relative to the input's scale "
                     f"(|x| up to {s:.3g}), which alone would allow {_fmt(low)}; but {floor_why or what} needs "
                     f"eps ≥ {floor:.2g} to stay below {dtype}'s largest value {fi.max:.4g}")
        if eps > raw * 1e3:
            reasoning += (" — that is large next to your values, so a wider dtype (float32 / bfloat16 range) "
                          "may be the better fix")
    return eps, reasoning


def eps_candidates(eps: float) -> list[float]:
    """The chosen epsilon first, then larger ones in case the first does not verify."""
    return [eps, eps * 1e2, eps * 1e4]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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
_LOG_PACKETS = ("aten.log", "aten.log2", "aten.log10")
_LOG_BASE = {"aten.log": 1.0, "aten.log2": 1 / math.log(2), "aten.log10": 1 / math.log(10)}


def _log_family(s: Site) -> bool:
    return s.packet in _LOG_PACKETS and s.call_is("log", "log2", "log10")


def _stable_log_candidate(s: Site) -> bool:
    """A log the stable-form rules may claim: not one whose result where() picks from (the where trap)."""
    return _log_family(s) and "aten.where" not in s.consumer_packets()


def _view_of(base_in: Any, base_out: Any, q: Any) -> torch.Tensor | None:
    """`q` is `base_out` or a view of it (a squeeze, a slice): the same view of `base_in`; else None.

    A patch that replaces log(f(x)) by a stable g(x) needs this when the user took a
    view of f(x) in between (`torch.sigmoid(z).squeeze(-1)`).
    """
    if not all(isinstance(t, torch.Tensor) for t in (base_in, base_out, q)):
        return None
    if base_in.shape != base_out.shape:
        return None
    if q is base_out:
        return base_in
    try:
        if q.untyped_storage().data_ptr() != base_out.untyped_storage().data_ptr() or not base_out.is_contiguous():
            return None
    except (RuntimeError, NotImplementedError):
        return None
    return base_in.contiguous().as_strided(q.size(), q.stride(), q.storage_offset() - base_out.storage_offset())


def _softmax_dim(args, kwargs) -> int:
    return kwargs.get("dim", args[1] if len(args) > 1 else -1)


def _stable_log_patch(inner: OpRecord, logs: list[OpRecord], stable: Callable[[tuple, dict], torch.Tensor],
                      negate: list[OpRecord] = ()) -> dict[int, Callable] | None:
    """Patches for log(f(x)) -> stable(x): remember f's input and output at its call, then answer each
    log call whose argument is (a view of) f's output with the same view of stable(x). `negate` are
    `1 - f(x)` calls: a log of their output becomes stable(-x) (log(1 - sigmoid(z)) = logsigmoid(-z))."""
    calls = [inner.call] + [r.call for r in logs] + [r.call for r in negate]
    if not all(calls) or len(set(calls)) != len(calls):
        return None  # not separate user calls: nothing to intercept one by one
    state: dict = {"complements": []}

    def grab(func, args, kwargs):
        out = func(*args, **kwargs)
        state.update(args=args, kwargs=kwargs, out=out)
        return out

    def grab_complement(func, args, kwargs):
        out = func(*args, **kwargs)
        p = next((a for a in args if _view_of(state.get("out"), state.get("out"), a) is not None), None)
        if p is not None:
            state["complements"].append((out, p))
        return out

    def stable_log(base: float):
        def fn(func, args, kwargs):
            q = args[0]
            if "out" in state:
                x = state["args"][0]
                v = _view_of(x, state["out"], q)
                if v is not None:
                    return _view_of(stable((x, *state["args"][1:]), state["kwargs"]), state["out"], q) * base
                for out, p in state["complements"]:
                    if q is out:
                        return _view_of(stable((-x, *state["args"][1:]), state["kwargs"]), state["out"], p) * base
            return func(*args, **kwargs)
        return fn

    patch = {inner.call: grab}
    patch.update({r.call: grab_complement for r in negate})
    patch.update({r.call: stable_log(_LOG_BASE[packet(str(r.op))]) for r in logs})
    return patch


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


@rule("bce_saturated", *_LOGS)
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
    patch = _stable_log_patch(sg, direct + of_complement, lambda a, k: F.logsigmoid(a[0]), complements)
    Fn = codefix.functional(s.source["path"] if s.source else None)
    code = (f"# {_frame_at(sg)}: return the logits z instead of torch.sigmoid(z), then\n"
            f"loss = {Fn}.binary_cross_entropy_with_logits(z, y)\n"
            f"# (by hand: torch.log(p) -> {Fn}.logsigmoid(z), torch.log(1 - p) -> {Fn}.logsigmoid(-z))")
    which = "1, so log(1 - p) = log(0)" if s.origin(0) is not sg else "0, so log(p) = log(0)"
    return Diagnosis(
        "bce_saturated", "hand-written binary cross-entropy on a saturated sigmoid",
        f"p = sigmoid(z) rounded to exactly {which} = -inf at {s.where}: in {s.dtype}, sigmoid(z) is exactly 1 "
        f"for z above about {_sigmoid_one(s.finfo):.0f} and exactly 0 below about {_sigmoid_zero(s.finfo):.0f}. "
        "Computing binary cross-entropy from probabilities loses everything beyond float precision; "
        f"compute it from the logits (sigmoid at {_frame_at(sg)}).",
        [Fix("bce_with_logits", code, patch=patch,
             reasoning="binary_cross_entropy_with_logits uses log(sigmoid(z)) = -softplus(-z), exact for any logit")])


@rule("logsigmoid", *_LOGS)
def _log_of_sigmoid(s: Site) -> Diagnosis | None:
    sg = s.origin(0)
    if sg is None or packet(str(sg.op)) != "aten.sigmoid" or not _stable_log_candidate(s):
        return None
    patch = _stable_log_patch(sg, [s.rec], lambda a, k: F.logsigmoid(a[0]))
    Fn = codefix.functional(s.source["path"] if s.source else None)
    rw = s.rewrite(lambda src, node: _wrapped_call_text(node, src, "sigmoid", f"{Fn}.logsigmoid"))
    generic = f"{Fn}.logsigmoid(z)  # instead of torch.log(p), p = torch.sigmoid(z) at {_frame_at(sg)}"
    return Diagnosis(
        "logsigmoid", "log(sigmoid(x)): sigmoid saturated to 0 and log made it -inf",
        f"sigmoid(x) rounds to exactly 0 in {s.dtype} for x below about {_sigmoid_zero(s.finfo):.0f}, and "
        f"log(0) = -inf at {s.where}.",
        [Fix("logsigmoid", generic, rewrite=rw, patch=patch,
             reasoning="logsigmoid(x) = -softplus(-x) is exact for any x")])


@rule("log_softmax", *_LOGS)
def _log_of_softmax(s: Site) -> Diagnosis | None:
    sm = s.origin(0)
    if sm is None or packet(str(sm.op)) not in ("aten._softmax", "aten.softmax") or not _stable_log_candidate(s):
        return None
    patch = _stable_log_patch(sm, [s.rec], lambda a, k: torch.log_softmax(a[0], dim=_softmax_dim(a, k)))
    rw = s.rewrite(lambda src, node: _wrapped_call_text(node, src, "softmax", "torch.log_softmax"))
    generic = (f"torch.log_softmax(logits, dim=-1)  # instead of torch.log(p), p = softmax(logits) "
               f"at {_frame_at(sm)}")
    return Diagnosis(
        "log_softmax", "log(softmax(x)): softmax underflowed to 0 and log made it -inf",
        f"softmax returned exactly 0 for some entries (their logits were far below the row's maximum), "
        f"and log(0) = -inf {'in forward' if s.forward else 'gave 0/0 = NaN in its backward (grad / p)'}. "
        f"This is the seed's `log(softmax(x))` collapse at {s.where}.",
        [Fix("log_softmax", generic, rewrite=rw, patch=patch,
             reasoning="log_softmax computes x - logsumexp(x) directly, so it never takes log(0)")])


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
        fixes.append(Fix("xlogy", "torch.special.xlogy(p, p)  # = p * log(p), defined as 0 where p == 0",
                         patch={s.call: grab_log, mrec.call: xlogy},
                         reasoning="xlogy(x, y) = x*log(y) with 0 where x == 0 — but its gradient with respect "
                                   "to y is x/y, still 0/0 = NaN at p == 0"))
    for e in eps_candidates(eps):
        rw = s.rewrite(codefix.with_operand("input", lambda t, e=e: f"{codefix.paren(t)}.clamp_min({_fmt(e)})"))
        fixes.append(Fix("clamp", f"p * torch.log(p.clamp_min({_fmt(e)}))", epsilon=e,
                         rewrite=rw,
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
        [Fix("double_where", f"torch.where(cond, {fn_name}(torch.where({cond}, x, {safe})), other)",
             rewrite=rw, patch=patch,
             reasoning="the inner where feeds the op only values where it is defined; the outer where "
                       "keeps the result exactly as before")])


# ------------------------------------------------------------------ log / sqrt / pow / acos at the domain edge


def _edge_fix(s: Site, kind: str, scale: float | None, what: str, change_code: Callable[[str, float], str],
              change: Callable[[torch.Tensor, float], torch.Tensor], generic: Callable[[float], str],
              which: str = "input", arg: int = 0, floor: float | None = None, floor_why: str = "",
              call: int | None = None, call_name: str | None = None, line: int | None = None) -> list[Fix]:
    """Candidate fixes that change one operand of the culprit call (or of `call`) by an epsilon."""
    eps, why = choose_eps(s.dtype, scale, what, floor=floor, floor_why=floor_why)
    call = s.call if call is None else call
    fixes = []
    for e in eps_candidates(eps):
        rw = s.rewrite(codefix.with_operand(which, lambda t, e=e: change_code(t, e)), call_name, line)
        fixes.append(Fix(kind, generic(e), epsilon=e, reasoning=why,
                         rewrite=rw,
                         patch={call: _replace_arg(arg, lambda t, e=e: change(t, e))} if call else None))
    return fixes


def _plus_eps(t: str, e: float) -> str:
    return codefix.plus(t, _fmt(e))


def _clamp_eps(t: str, e: float) -> str:
    return f"{codefix.paren(t)}.clamp_min({_fmt(e)})"


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


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
                      _plus_eps, lambda t, e: t + e, lambda e: f"torch.log(p + {_fmt(e)})",
                      floor=1 / s.finfo.max, floor_why="the gradient 1/(x + eps)")
    what = "-inf in forward" if s.forward else "0/0 = NaN in its backward (grad / x with x = 0)"
    return Diagnosis("log_of_zero", "log of zero",
                     f"log received {_count(x.get('zeros', 0), 'exact zero')} at {s.where}: log(0) = -inf, "
                     f"and here that became {what}.", fixes)


@rule("log_of_negative", *_LOGS)
def _log_negative(s: Site) -> Diagnosis | None:
    x = s.inp(0)
    if not (s.forward and _log_family(s) and x.get("negatives", 0)):
        return None
    fixes = _edge_fix(s, "clamp", x.get("absmax"), "log(x.clamp_min(eps)) and its gradient",
                      _clamp_eps, lambda t, e: t.clamp_min(e), lambda e: f"torch.log(x.clamp_min({_fmt(e)}))",
                      floor=1 / s.finfo.max, floor_why="the gradient 1/eps")
    return Diagnosis("log_of_negative", "log of a negative number",
                     f"log received {_count(x['negatives'], 'negative value')} (min {x.get('min')}) at {s.where}: log(x<0) = "
                     "NaN. Check why the input can be negative; clamp it if that is expected.", fixes)


def _sqrt_call(s: Site) -> bool:
    return s.packet == "aten.sqrt" and s.call_is("sqrt")


@rule("sqrt_cancellation", aten.sqrt)
def _sqrt_cancel(s: Site) -> Diagnosis | None:
    """sqrt(E[x^2] - E[x]^2): rounding makes a zero variance slightly negative."""
    x = s.inp(0)
    if not (s.forward and _sqrt_call(s) and x.get("negatives", 0)) or s.origin_packet(0) != "aten.sub":
        return None
    # A zero variance computed as a difference comes out as rounding noise: |noise| ≈ eps(dtype) * E[x²].
    # So the negatives tell the scale of the terms that cancelled.
    lo = abs(_num(x.get("min")) or 0.0)
    terms = lo / s.finfo.eps
    scale = max(_num(x.get("absmax")) or 0.0, terms)
    fixes = _edge_fix(s, "clamp", scale, "sqrt(var.clamp_min(0) + eps) and its gradient 1/(2*sqrt(eps))",
                      lambda t, e: f"{codefix.paren(t)}.clamp_min(0) + {_fmt(e)}",
                      lambda t, e: t.clamp_min(0) + e, lambda e: f"torch.sqrt(var.clamp_min(0) + {_fmt(e)})")
    return Diagnosis("sqrt_cancellation", "sqrt of a variance computed as E[x²] − E[x]²",
                     f"sqrt's input is a difference with {_count(x['negatives'], 'negative value')} (min {x.get('min')}): "
                     f"computed as E[x²] − E[x]², a zero variance (a constant feature) cancels to rounding noise of "
                     f"about {s.dtype}'s eps × E[x²] (here E[x²] is of order {terms:.2g}), which can be negative, and sqrt of "
                     f"a negative is NaN at {s.where}. Clamp at 0 then add eps, or compute the variance as "
                     "torch.var(x, dim, correction=0) or ((x - mean) ** 2).mean(), which do not cancel.", fixes)


@rule("sqrt_of_negative", aten.sqrt)
def _sqrt_negative(s: Site) -> Diagnosis | None:
    x = s.inp(0)
    if not (s.forward and _sqrt_call(s) and x.get("negatives", 0)):
        return None
    fixes = _edge_fix(s, "clamp", x.get("absmax"), "sqrt and its gradient",
                      lambda t, e: f"{codefix.paren(t)}.clamp_min(0) + {_fmt(e)}",
                      lambda t, e: t.clamp_min(0) + e, lambda e: f"torch.sqrt(x.clamp_min(0) + {_fmt(e)})")
    return Diagnosis("sqrt_of_negative", "sqrt of a negative number",
                     f"sqrt received {_count(x['negatives'], 'negative value')} (min {x.get('min')}) at {s.where}: "
                     "sqrt(x<0) = NaN in forward, and anomaly mode would flag its backward.", fixes)


@rule("sqrt_at_zero", aten.sqrt)
def _sqrt_zero(s: Site) -> Diagnosis | None:
    if not _sqrt_call(s) or s.forward or s.event.node != "SqrtBackward0":
        return None
    denom = s.inp(1)  # SqrtBackward0: grad / (2 * sqrt(x))
    amax = _num(denom.get("absmax"))
    scale = (amax / 2) ** 2 if amax is not None else None
    fixes = _edge_fix(s, "epsilon", scale, "the gradient 1/(2*sqrt(x + eps))",
                      _plus_eps, lambda t, e: t + e, lambda e: f"torch.sqrt(x + {_fmt(e)})",
                      floor=(1 / (2 * s.finfo.max)) ** 2, floor_why="the gradient 1/(2*sqrt(eps))")
    return Diagnosis("sqrt_at_zero", "sqrt at zero: infinite gradient",
                     f"sqrt's input held exact zeros at {s.where}. sqrt(0) = 0 is fine in forward, but its "
                     "derivative 1/(2*sqrt(x)) is Inf there — the seed's `sqrt(0).backward()` case (often a "
                     "distance or norm between identical vectors).", fixes)


def _exponent(s: Site) -> float | None:
    """The exponent a of x ** a (in backward, PowBackward0 computes x ** (a - 1))."""
    v = next((v for v in s.event.scalars or [] if isinstance(v, (int, float)) and not isinstance(v, bool)), None)
    if v is None:
        return None
    return float(v) if s.forward else float(v) + 1


def _pow_call(s: Site) -> bool:
    return s.packet == "aten.pow" and s.call_is("pow", "__pow__", "float_power")


@rule("pow_of_negative", aten.pow)
def _pow_negative(s: Site) -> Diagnosis | None:
    x = s.inp(0)
    a = _exponent(s)
    if not (s.forward and _pow_call(s) and x.get("negatives", 0) and a is not None and a != int(a)):
        return None
    fixes = _edge_fix(s, "clamp", x.get("absmax"), f"x ** {a:g} and its gradient",
                      _clamp_eps, lambda t, e: t.clamp_min(e), lambda e: f"x.clamp_min({_fmt(e)}) ** {a:g}",
                      floor=(abs(a) / s.finfo.max) ** (1 / (1 - a)) if a < 1 else None,
                      floor_why=f"the gradient {a:g} * eps ** {a - 1:g}")
    return Diagnosis("pow_of_negative", f"fractional power ({a:g}) of a negative number",
                     f"x ** {a:g} is NaN for x < 0 ({_count(x['negatives'], 'such value')}, min {x.get('min')}) at {s.where}. "
                     "A fractional power is only defined for x ≥ 0: clamp the base (or use "
                     f"x.sign() * x.abs() ** {a:g} if negative inputs are meaningful).", fixes)


@rule("pow_at_zero", aten.pow)
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
    fixes = _edge_fix(s, "epsilon", x.get("absmax"),
                      f"(x + eps) ** {a:g} and its gradient {a:g} * (x + eps) ** {a - 1:g}",
                      _plus_eps, lambda t, e: t + e, lambda e: f"(x + {_fmt(e)}) ** {a:g}",
                      floor=floor, floor_why=f"{'the gradient ' if a > 0 else ''}eps ** {a - 1 if a > 0 else a:g}")
    if a > 0:
        title, what = (f"x ** {a:g} at x = 0: infinite gradient",
                       f"x ** {a:g} is 0 at x = 0, but its derivative {a:g} * x ** {a - 1:g} has a negative power, "
                       f"so it is Inf there")
    else:
        title, what = f"x ** {a:g} at x = 0: infinite value", f"x ** {a:g} = 1 / x ** {-a:g} is Inf at x = 0"
    return Diagnosis("pow_at_zero", title,
                     f"{what} ({_count(x.get('zeros', 0), 'exact zero')} in x, {s.where}). Add a small eps to the base.", fixes)


@rule("acos_asin_boundary", aten.acos, aten.asin)
def _acos(s: Site) -> Diagnosis | None:
    name = s.packet.split(".")[1]
    if not s.call_is(name, "arccos", "arcsin"):
        return None
    x = s.inp(0)
    # 1 - eps must be a value the dtype can tell apart from 1 (the spacing just below 1 is finfo.eps / 2);
    # there the derivative 1/sqrt(1 - x²) ≈ 1/sqrt(2 eps) is large but finite.
    eps = float(f"{10.0 ** math.ceil(math.log10(s.finfo.eps)):.0e}")
    fixes = []
    for e in (eps, eps * 10, eps * 100):
        lo, hi = f"-1 + {_fmt(e)}", f"1 - {_fmt(e)}"
        rw = s.rewrite(codefix.with_operand("input", lambda t, lo=lo, hi=hi: f"{codefix.paren(t)}.clamp({lo}, {hi})"))
        fixes.append(Fix("clamp", f"torch.{name}(x.clamp({lo}, {hi}))", epsilon=e,
                         rewrite=rw,
                         patch={s.call: _replace_arg(0, lambda t, e=e: t.clamp(-1 + e, 1 - e))} if s.call else None,
                         reasoning=f"the derivative ∓1/sqrt(1 - x²) is Inf at |x| = 1 and {name} is NaN beyond; "
                                   f"{s.dtype} tells 1 - {_fmt(e)} apart from 1 (its spacing below 1 is "
                                   f"{s.finfo.eps / 2:.1e}), so the clamped input keeps value and gradient finite"))
    if s.forward:
        expl = (f"{name} received {s.event.out.get('nan', 0)} values outside [-1, 1] (x range seen: {x.get('min')} .. "
                f"{x.get('max')}) at {s.where}, so it is NaN there — typically a cosine computed by hand that rounding "
                "pushed to 1.0000001.")
    else:
        expl = (f"{name}'s input was exactly ±1 at {s.where}: {name}(±1) is finite, but its derivative "
                f"∓1/sqrt(1 - x²) is Inf there (in {s.event.node}). Typical sources: a clamp(-1, 1) that pins values "
                "to the boundary, a saturated tanh, the cosine of identical vectors.")
    return Diagnosis("acos_asin_boundary", f"{name} at the edge of its domain", expl, fixes)


# ------------------------------------------------------------------ division, normalisation, std


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


def _population(eps: float | None) -> Callable:
    """std/var(..., correction=0) at this call, then (for a denominator) .clamp_min(eps)."""
    def fn(func, args, kwargs):
        x, dim, keepdim = _std_args(args, kwargs)
        out = func(x, dim, correction=0, keepdim=keepdim) if dim is not None else func(x, correction=0, keepdim=keepdim)
        return out if eps is None else out.clamp_min(eps)
    return fn


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
    parts.append("correction=0")
    head = src(node.func)
    if codefix._is_function_call(node):
        parts.insert(0, src(node.args[0]))
    text = f"{head}({', '.join(parts)})"
    return text if eps is None else f"{text}.clamp_min({_fmt(eps)})"


@rule("std_single_element", aten.std, aten.var)
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
        generic = f"x.{name}(dim, correction=0)" + (f".clamp_min({_fmt(e)})" if e else "")
        fixes.append(Fix("correction", generic, epsilon=e, rewrite=rw, patch={s.call: _population(e)} if s.call else None,
                         reasoning=f"correction=0 (the population {name}) is 0, not NaN, for one element"
                                   + (f"; it is then a zero denominator, hence clamp_min — {why}" if e else "")))
    return Diagnosis("std_single_element", f"unbiased {name} over a single element",
                     f"{s.call_name}() uses Bessel's correction (divide by n - 1); over one element that is 0/0 = NaN "
                     f"({s.where}). A batch or group of size 1 does this: use correction=0 (or skip groups of one)"
                     + (f", and since the {name} is then 0, keep it away from 0 where it divides." if denominator
                        else "."), fixes)


def _floor_clamped(num: dict, fi: torch.finfo) -> float | None:
    """x / y.clamp_min(eps): where it clamps no gradient reaches y, so only x / eps must stay finite."""
    n = _num(num.get("absmax"))
    return n / fi.max if n else None


@rule("empty_reduction", aten.nll_loss_forward, aten.nll_loss2d_forward, aten.mean)
def _empty_reduction(s: Site) -> Diagnosis | None:
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
        fix = Fix("guard_empty_reduction",
                  "x.sum() / max(x.numel(), 1)  # mean of an empty tensor is NaN",
                  rewrite=rw,
                  patch={s.call: guarded_mean} if s.call else None,
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
        tgt = args[1] if len(args) > 1 else kwargs["target"]
        ii = kwargs.get("ignore_index", -100)
        w = kwargs.get("weight", args[2] if len(args) > 2 else None)
        valid = tgt != ii
        n = valid.sum() if w is None else w[tgt.masked_fill(~valid, 0)].masked_fill(~valid, 0).sum()
        kw = {**kwargs, "reduction": "sum"}
        return func(*args, **kw) / torch.where(n > 0, n, torch.ones_like(n))
    rw = s.rewrite(lambda src, node: _guarded_ce_text(src, node, ignore))
    Fn = codefix.functional(s.source["path"] if s.source else None)
    generic = (f"n = (y != {ignore}).sum()\nloss = {Fn}.cross_entropy(logits, y, ignore_index={ignore}, "
               "reduction='sum') / n.clamp_min(1)")
    fix = Fix("guard_empty_reduction", generic, rewrite=rw,
              patch={s.call: guarded} if s.call and s.call_is("cross_entropy", "nll_loss") else None,
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
    return f"{src(node.func)}({', '.join(parts)}) / ({src(target)} != {ignore}).sum().clamp_min(1)"


_NORMS = ("aten.linalg_vector_norm", "aten.norm", "aten.sqrt", "aten.std", "aten.var", "aten.sum", "aten.abs")
_DIVS = ("div", "__truediv__", "true_divide", "divide")


@rule("normalize_zero_norm", aten.div)
def _normalize(s: Site) -> Diagnosis | None:
    if not (s.forward and s.op_packet == "aten.div" and s.call_is(*_DIVS)):
        return None
    idx = 1
    d = s.inp(idx)
    prod = s.origin_packet(idx)
    if not d.get("zeros") or prod not in _NORMS or s.event.kind != "nan":
        return None
    is_std = prod in ("aten.std", "aten.var", "aten.sqrt")
    label = "standard deviation" if is_std else "norm"
    num = s.inp(0)
    fixes = _edge_fix(s, "epsilon", num.get("absmax"), f"x / {label}.clamp_min(eps) and its gradient",
                      _clamp_eps, lambda t, e: t.clamp_min(e),
                      lambda e: f"x / x.norm(dim=-1, keepdim=True).clamp_min({_fmt(e)})  "
                                f"# or F.normalize(x, dim=-1, eps={_fmt(e)})",
                      which="other", arg=idx, floor=_floor_clamped(num, s.finfo), floor_why="the quotient x / eps")
    what = ("(x - mean) / std with a constant feature or group (std = 0 and x - mean = 0)" if is_std
            else "x / x.norm() with an all-zero vector (norm = 0)")
    return Diagnosis("normalize_zero_norm", f"division by a zero {label}",
                     f"{what}: {_count(d['zeros'], 'zero denominator')} at {s.where}, giving 0/0 = NaN.", fixes)


@rule("division_by_zero", aten.div, aten.reciprocal)
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
    n = _num(num.get("absmax")) or 0.0
    if d.get("negatives"):  # a signed denominator: clamp_min would flip its sign; push exact zeros off 0 instead
        code, change, generic = _plus_eps, (lambda t, e: t + e), (lambda e: f"x / (y + {_fmt(e)})")
        # the gradient reaches the denominator through `+ eps`: x / eps² must stay finite
        floor, floor_why = (math.sqrt(n / s.finfo.max) if n else None), "the gradient x / eps²"
    else:  # clamp_min: where it clamps, no gradient reaches the denominator; only the quotient x / eps must fit
        code, change, generic = _clamp_eps, (lambda t, e: t.clamp_min(e)), (lambda e: f"x / y.clamp_min({_fmt(e)})")
        floor, floor_why = (n / s.finfo.max if n else None), "the quotient x / eps"
    fixes = _edge_fix(s, "epsilon", d.get("absmax") or n, "the quotient and its gradient",
                      code, change, generic, which=which, arg=idx, floor=floor, floor_why=floor_why)
    return Diagnosis("division_by_zero", "0/0" if zero_zero else "division by zero",
                     f"the denominator held {_count(d['zeros'], 'exact zero')} (range {d.get('min')} .. {d.get('max')}) at "
                     f"{s.where}: {'0/0 = NaN' if zero_zero else 'x/0 = Inf'}. Keep the denominator away from 0, or "
                     "mask the rows where it is 0.", fixes)


# ------------------------------------------------------------------ exp, softmax, masks


def _sum_dim(s: Site, sum_rec: OpRecord | None) -> tuple[Any, bool, bool]:
    """(dim, keepdim, known) of the user's sum over exp(x), read from their source line."""
    if sum_rec is None or not sum_rec.call:
        return -1, False, False
    fr = frame_json(sum_rec.frame)
    name = s.step.call_names[sum_rec.call] if sum_rec.call < len(s.step.call_names) else None
    dim = codefix.literal_argument(fr and fr["path"], fr and fr["line"], name, "dim", 0)
    keep = codefix.literal_argument(fr and fr["path"], fr and fr["line"], name, "keepdim", 1, default=False)
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


@rule("handwritten_softmax", aten.exp)
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
    if log_rec is not None:
        patch = None
        if s.call and log_rec.call and len({s.call, log_rec.call, sum_rec.call}) == 3:
            state: dict = {}

            def grab(func, args, kwargs):
                state["x"] = args[0]
                return func(*args, **kwargs)
            patch = {s.call: grab, log_rec.call: lambda func, a, k: torch.logsumexp(state["x"], dim, keepdim=keep)}
        fr = frame_json(log_rec.frame)
        lname = s.step.call_names[log_rec.call] if 0 < log_rec.call < len(s.step.call_names) else None
        rw = s.rewrite(lambda src, node: _logsumexp_text(src, node, f"dim={dim!r}"), lname, fr and fr["line"])
        code = f"torch.logsumexp(x, dim={dim!r})  # not torch.log(torch.exp(x).sum({dim!r}))"
        title, stable = "hand-written logsumexp overflowed", "torch.logsumexp"
        then = "and log(Inf) = Inf"
    else:
        def patch_fn(func, args, kwargs):
            t = args[0]
            return func(t - t.detach().amax(dim=dim, keepdim=True), *args[1:], **kwargs)
        calls = [r.call for r in siblings]
        patch = {c: patch_fn for c in calls} if all(calls) and len(set(calls)) == len(calls) else None
        rw = None
        if len(siblings) == 1:  # one exp call to rewrite on the user's line
            rw = s.rewrite(codefix.with_operand(
                "input", lambda t: codefix.plus(t, f"{codefix.paren(t)}.amax(dim={dim!r}, keepdim=True)", "-")))
        code = f"torch.softmax(x, dim={dim!r})  # not x.exp() / x.exp().sum({dim!r}, keepdim=True)"
        title, stable = "hand-written softmax overflowed", "torch.softmax"
        then = "then the normalisation made Inf/Inf = NaN"
    return Diagnosis("handwritten_softmax", title,
                     f"exp overflowed to Inf for inputs above {lim:.1f} ({s.dtype}; max seen {x.get('max')}) at "
                     f"{s.where}, {then}. Subtracting the maximum over the summed dim first (what torch.softmax and "
                     f"torch.logsumexp do) keeps exp ≤ 1 and changes nothing mathematically.",
                     [Fix("max_subtraction", code, rewrite=rw,
                          patch=patch, reasoning=f"{stable} is the stable form: exp(x - max) never overflows"
                          + assumed)])


@rule("exp_overflow", aten.exp)
def _exp_overflow(s: Site) -> Diagnosis | None:
    if not (s.forward and s.call_is("exp") and s.event.kind == "inf"):
        return None
    x = s.inp(0)
    lim = math.floor(math.log(s.finfo.max)) - 1
    fixes = []
    rw = s.rewrite(codefix.with_operand("input", lambda t: f"{codefix.paren(t)}.clamp(max={lim})"))
    fixes.append(Fix("clamp", f"torch.exp(x.clamp(max={lim}))", rewrite=rw,
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
    lits = [e for e in s.chain_events() if e.role == "literal" and e.index < s.event.index and e.fwd is not None]
    recs = list({id(r): r for r in (s.step.ops[e.fwd] for e in lits) if r.call}.values())
    patch = {r.call: _finite_mask for r in recs} or None
    rws = []
    for r in recs:
        fr = frame_json(r.frame)
        name = s.step.call_names[r.call] if r.call < len(s.step.call_names) else None
        rw = fr and s.rewrite(lambda src, node: _finite_mask_text(src, node, s.dtype), name, fr["line"])
        if rw and all(rw.before != o.before for o in rws):
            rws.append(rw)
    rws.sort(key=lambda r: r.line)
    before = "\n".join(r.before for r in rws) or None
    after = "\n".join(r.after for r in rws) or None
    code = after or "scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)  # not float('-inf')"
    return Diagnosis("softmax_all_masked", "softmax over a fully masked row",
                     f"every entry of some softmax row was -inf (a mask with no allowed position, e.g. an all-padding "
                     f"sequence), so softmax computed exp(-inf - (-inf)) = NaN at {s.where}. A healthy causal mask is "
                     "fine; an empty row is not. Use the dtype's most negative finite value as the mask value "
                     "(the row then becomes uniform, and you can zero it), or drop empty rows.",
                     [Fix("finite_mask_value", code, before=before, after=after, patch=patch,
                          reasoning="finfo(dtype).min behaves like -inf for every row that has an allowed position, "
                                    "and keeps fully masked rows finite")])


def _finite_mask(func, args, kwargs):
    """Run the call with every -inf constant argument replaced by the dtype's most negative finite value."""
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


def _finite_mask_text(src, node, dtype: str) -> str | None:
    """s.masked_fill(m, float('-inf')) -> s.masked_fill(m, torch.finfo(s.dtype).min); the same for where()."""
    ast = codefix.ast
    if not isinstance(node, ast.Call):
        return None
    values = list(node.args) + [k.value for k in node.keywords]
    lit = next((v for v in values if _is_neg_inf(v)), None)
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


# ------------------------------------------------------------------ precision and exploded weights

def _low_precision(s: Site) -> bool:
    return s.dtype in ("float16", "bfloat16") or bool(s.subject.autocast)


@rule("fp16_overflow")
def _fp16(s: Site) -> Diagnosis | None:
    if not _low_precision(s) or s.event.role != "origin" or s.event.kind != "inf":
        return None
    big = max((st.get("absmax") or 0 for st in s.inputs if isinstance(st.get("absmax"), (int, float))), default=0)
    low = s.dtype if s.dtype in ("float16", "bfloat16") else str((s.subject.autocast or {}).get("dtype", "float16"))
    low = low.removeprefix("torch.")
    lmax = torch.finfo(getattr(torch, low, torch.float16)).max
    auto = s.subject.autocast
    if auto:
        dev = auto.get("device_type", "cuda")
        code = (f"with torch.autocast({dev!r}, dtype=torch.bfloat16):  # instead of {low}\n"
                "    loss = ...\n"
                f"# or keep {low} and scale the loss: scaler = torch.amp.GradScaler({dev!r})")
        variant = {"autocast": {**auto, "dtype": torch.bfloat16}, "label": "under bfloat16 autocast"}
        where_run = f"under torch.autocast({dev!r}, dtype=torch.{low})"
    else:
        code = ("model = model.to(torch.bfloat16)  # same range as float32\n"
                "# or keep float32 weights, run under torch.autocast(..., dtype=torch.float16) and scale the loss "
                "with torch.amp.GradScaler()")
        variant = {"dtype": torch.bfloat16, "label": "in bfloat16"}
        where_run = f"in {low}"
    return Diagnosis("fp16_overflow", f"{low} overflow",
                     f"{s.event.op} produced Inf from finite inputs (|x| up to {big:.4g}) {where_run}, whose largest "
                     f"value is {lmax:.0f} ({s.where}). The same op is finite in a wider dtype. bfloat16 has float32's "
                     "range; in backward, a GradScaler keeps scaled gradients in range and skips the step on overflow.",
                     [Fix("bf16_or_grad_scaler", code, variant=variant,
                          reasoning="bfloat16 trades mantissa bits for float32's exponent range")])


@rule("exploded_weights")
def _exploded(s: Site) -> Diagnosis | None:
    """Inf from finite inputs in a full-range dtype, with parameters already huge: an earlier step diverged."""
    if s.event.role != "origin" or s.event.kind != "inf":
        return None
    limit = min(1e5, math.sqrt(s.finfo.max) / 16)
    seen = max((v for v in (_num(st.get("absmax")) for st in s.inputs) if v is not None), default=0.0)
    if seen < limit:
        return None  # the overflowing op never saw a huge value: something else is going on
    big = [(n, float(p.detach().abs().max())) for n, p in s.subject.model.named_parameters()
           if p.is_floating_point() and p.numel()]
    huge = [(n, v) for n, v in big if v > limit]
    if not huge:
        return None
    huge.sort(key=lambda nv: -nv[1])
    names = ", ".join(f"{n} (max |w| {v:.3g})" for n, v in huge[:3])
    return Diagnosis("exploded_weights", "weights already exploded",
                     f"{s.event.op} overflowed {s.dtype} (largest value {s.finfo.max:.3g}; its inputs reached "
                     f"{seen:.3g}) at {s.where} because the parameters are already huge: {names}. The step itself is "
                     "not the bug — earlier steps grew the weights. Lower the learning rate, clip gradients, and "
                     "restore the last good checkpoint.",
                     [Fix("lower_lr_clip_grads",
                          "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
                          "# and: lower the learning rate; restore the last checkpoint with finite, sane weights",
                          reasoning="the weights themselves are the problem: no change at this op makes them sane "
                                    "again, so there is nothing to verify by replaying this step")])


def _input_summary(st: dict) -> str:
    if not st:
        return "?"
    parts = [f"{st.get('dtype')}{st.get('shape')}"]
    if st.get("min") is not None:
        parts.append(f"range {st['min']:.4g} .. {st['max']:.4g}")
    for k in ("zeros", "negatives", "nan", "inf"):
        if st.get(k):
            parts.append(f"{st[k]} {k}")
    return ", ".join(parts)


@rule("unrecognised")
def _generic(s: Site) -> Diagnosis:
    op = s.event.op
    what = {"origin": "computed a non-finite value from finite inputs",
            "conversion": "turned Inf into NaN (inf - inf, 0 * inf, or a fully -inf softmax row)",
            "literal": "holds a non-finite constant from its arguments"}.get(s.event.role, "propagated a non-finite value")
    phase = (f"in backward ({s.event.node}, the gradient of {s.fwd_op})" if not s.forward else "in forward")
    out = s.event.out
    made = ", ".join(f"{out[k]} {k}" for k in ("nan", "posinf", "neginf") if out.get(k)) or "non-finite values"
    seen = "; ".join(f"input {i}: {_input_summary(st)}" for i, st in enumerate(s.inputs)) or "no tensor inputs"
    scal = f"; other arguments {s.event.scalars}" if s.event.scalars else ""
    return Diagnosis("unrecognised", f"{op} {what}",
                     f"{op} {what} {phase} at {s.where}: it produced {made} of {out.get('numel')} elements ({seen}"
                     f"{scal}). nanreplay has no specific rule for this pattern, so it suggests no fix rather than a "
                     "wrong one: check the op's domain against the input ranges above.",
                     [Fix("none", "# no automatic suggestion for this pattern")])


# ------------------------------------------------------------------ entry points


def diagnose(result, subject, step: Step, c: int | None, chain: list[int], *, verify_fixes: bool = True) -> dict:
    """The `diagnosis` object of the JSON contract, with fixes verified by replay."""
    if c is None:
        return _not_reproduced(result, subject)
    site = Site(step, step.events[c], chain, subject)
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
    """What set_detect_anomaly(True) would have said, compared honestly with the culprit."""
    if anomaly.get("raises") is None:
        return ""
    if not anomaly["raises"]:
        if site is not None and site.event.kind == "inf" and not site.forward:
            return ("torch.autograd.set_detect_anomaly(True) would have stayed silent: it only checks backward "
                    "outputs for NaN, and this failure is Inf.")
        if site is not None and site.event.kind == "inf":
            return ("torch.autograd.set_detect_anomaly(True) would have stayed silent: it only checks backward "
                    "outputs for NaN, and this Inf never became a NaN in backward.")
        return ("torch.autograd.set_detect_anomaly(True) would have stayed silent: it only checks what backward "
                "nodes return, and no backward node returned NaN on this step.")
    node = anomaly["node"]
    src = anomaly.get("source") or {}
    at = f" ({anomaly['forward_op']} at {src['file']}:{src['line']})" if anomaly.get("forward_op") and src else ""
    if anomaly.get("agrees_with_culprit"):
        return f"set_detect_anomaly(True) would have raised at {node}{at}, which is this culprit's node."
    if site is None:
        return f"set_detect_anomaly(True) would have raised at {node}{at}."
    kind = site.event.kind.upper()
    if site.forward:
        return (f"set_detect_anomaly(True) would have raised only in backward, at {node}{at} — a later node than the "
                f"culprit: anomaly mode checks backward outputs for NaN only, so the {kind} this forward op made "
                "went unnoticed until then.")
    step = site.step
    seq = step.anomaly.node_seq if step.anomaly is not None else None
    hit = next((e for e in step.events if e.phase == "backward" and e.node_seq == seq and e.kind == "nan"), None)
    if hit is not None and hit.index > site.event.index and hit.index in site.chain:
        why = ("the culprit made Inf, which anomaly mode does not check; it raised only where that Inf became NaN"
               if site.event.kind == "inf" else "it raised only where the NaN came out of a node")
        return f"set_detect_anomaly(True) would have raised at {node}{at} — a later node than the culprit: {why}."
    return (f"set_detect_anomaly(True) would have raised at {node}{at}, which is not on this culprit's chain: "
            "a NaN that did not cause this failure reached it first.")


def _not_reproduced(result, subject) -> dict:
    explanation = ("Replaying the snapshot's step gave a finite loss and finite gradients everywhere. "
                   "Either the failure depends on state the snapshot does not hold (RNG for dropout, "
                   "nondeterministic kernels, a different device or dtype), or it happened in a later "
                   "step (e.g. the optimizer update). nanreplay does not invent a culprit.")
    near = [a for a in getattr(result, "activations", []) if a.get("near_overflow")]
    if near:
        worst = max(near, key=lambda a: a["ratio"] if isinstance(a.get("ratio"), float) else math.inf)
        fmax = torch.finfo(getattr(torch, worst["dtype"])).max
        more = f" (and {len(near) - 1} more)" if len(near) > 1 else ""
        explanation += (f" Close to overflow, though: module {worst['module'] or '<root>'!r}{more} reached "
                        f"|x| = {worst['absmax']:.4g}, {100 * worst['ratio']:.0f}% of {worst['dtype']}'s largest "
                        f"value {fmax:.6g}; slightly larger inputs or weights will overflow. bfloat16 (float32's "
                        "range) or a normalisation before that module gives headroom.")
    return {"cause": "not_reproduced", "title": "the replay is finite", "explanation": explanation,
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
