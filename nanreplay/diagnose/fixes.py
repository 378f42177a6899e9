"""The pieces fixes are made of: the epsilon policy, and runtime call-site patches.

Every fix that is a code change carries a *patch*, keyed by the call numbers the replay recorded,
as `fn(func, args, kwargs)`: a change of the user's line applies at every call that expression made
(each block of a transformer runs the same line); without a line to change it is an op-level patch
at the culprit's call. The engine verifies a fix by replaying the step with its patch; the first
candidate that makes the loss and every gradient finite *and plausible* is reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.model import Fix
from nanreplay.diagnose.site import Site, finite_float, packet
from nanreplay.enums import FixKind
from nanreplay.replay import OpRecord

# ------------------------------------------------------------------ epsilon


def choose_eps(dtype: str, scale: float | None, what: str, *, floor: float | None = None,
               floor_why: str = "", root_clamp: bool = False) -> tuple[float, str]:
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
    raw = fi.eps * s * (fi.eps if root_clamp else 1.0)
    eps = 10.0 ** math.floor(math.log10(raw))
    eps = max(eps, 10.0 ** math.ceil(math.log10(fi.tiny)))  # never below the smallest normal number
    eps = float(f"{eps:.0e}")  # a clean power of ten
    reasoning = (f"eps = {fmt(eps)}: {dtype} resolves about {fi.eps:.1e} relative to the input's scale "
                 f"(|x| up to {s:.3g}), so adding it moves no value that was fine by more than one rounding step, "
                 f"while {what} stays finite")
    if root_clamp:  # sqrt(x.clamp_min(eps)): values above eps unchanged; a 0 becomes sqrt(eps), below resolution
        reasoning = (f"eps = {fmt(eps)}: clamp_min leaves every value above it exactly as it was, and turns a 0 into "
                     f"sqrt(eps) = {math.sqrt(eps):.1g}, which {dtype} (resolution {fi.eps:.1e}) does not tell from 0 "
                     f"next to the outputs' scale (sqrt of {s:.3g}), while {what} stays finite")
    if floor is not None and math.isfinite(floor) and floor > eps:
        low = eps
        eps = float(f"{10.0 ** math.ceil(math.log10(floor)):.0e}")
        reasoning = (f"eps = {fmt(eps)}: {dtype} resolves about {fi.eps:.1e} relative to the input's scale "
                     f"(|x| up to {s:.3g}), which alone would allow {fmt(low)}; but {floor_why or what} needs "
                     f"eps ≥ {floor:.2g} to stay below {dtype}'s largest value {fi.max:.4g}")
        if eps > raw * 1e3:
            reasoning += (" — that is large next to your values, so a wider dtype (float32 / bfloat16 range) "
                          "may be the better fix")
    return eps, reasoning


def eps_candidates(eps: float, why: str) -> list[tuple[float, str]]:
    """(epsilon, its reasoning): the chosen one first (`why` explains it), then larger ones in case the first
    does not verify, each with its own reason — never the chosen one's."""
    out = [(eps, why)]
    for factor in (1e2, 1e4):
        e = float(f"{eps * factor:.0e}")
        out.append((e, f"eps = {fmt(e)}: {factor:g}× the eps chosen for this dtype and scale ({fmt(eps)}), tried "
                       f"in case that one does not verify: a wider margin from the edge, at the cost of moving "
                       f"values near it by up to {fmt(e)}"))
    return out


def fmt(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e+")


# ------------------------------------------------------------------ patches (call-site rewrites)


def replace_arg(i: int, change: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    def fn(func, args, kwargs):
        args = list(args)
        args[i] = change(args[i])
        return func(*args, **kwargs)
    return fn


def denominator_index(call_name: str) -> int:
    return 0 if call_name.rsplit(".", 1)[-1] in ("__rdiv__", "__rtruediv__") else 1


def view_of(base_in: Any, base_out: Any, q: Any) -> torch.Tensor | None:
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


_LOG_BASE = {"aten.log": 1.0, "aten.log2": 1 / math.log(2), "aten.log10": 1 / math.log(10)}


def stable_log_patch(inner: OpRecord, logs: list[OpRecord], stable: Callable[[tuple, dict], torch.Tensor],
                     negate: list[OpRecord] = (), every: Callable[[int], list[int]] | None = None,
                     ) -> dict[int, Callable] | None:
    """Patches for log(f(x)) -> stable(x): remember f's input and output at its call, then answer each
    log call whose argument is (a view of) f's output with the same view of stable(x). `negate` are
    `1 - f(x)` calls: a log of their output becomes stable(-x) (log(1 - sigmoid(z)) = logsigmoid(-z)).
    `every(call)`: the calls the same expression made in every execution of its line (a rewritten line
    changes them all); None: the recorded calls alone."""
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
        p = next((a for a in args if view_of(state.get("out"), state.get("out"), a) is not None), None)
        if p is not None:
            state["complements"].append((out, p))
        return out

    def stable_log(base: float):
        def fn(func, args, kwargs):
            q = args[0]
            if "out" in state:
                x = state["args"][0]
                v = view_of(x, state["out"], q)
                if v is not None:
                    return view_of(stable((x, *state["args"][1:]), state["kwargs"]), state["out"], q) * base
                for out, p in state["complements"]:
                    if q is out:
                        return view_of(stable((-x, *state["args"][1:]), state["kwargs"]), state["out"], p) * base
            return func(*args, **kwargs)
        return fn

    each = every or (lambda c: [c])
    patch = {c: grab for c in each(inner.call)}
    patch.update({c: grab_complement for r in negate for c in each(r.call)})
    patch.update({c: stable_log(_LOG_BASE[packet(str(r.op))]) for r in logs for c in each(r.call)})
    return patch


def finite_mask(func, args, kwargs):
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


# ------------------------------------------------------------------ an operand moved off the domain edge


def edge_fix(s: Site, kind: FixKind, scale: float | None, what: str, change_code: Callable[[str, float], str],
             change: Callable[[torch.Tensor, float], torch.Tensor], guidance: Callable[[float], str],
             which: str = "input", arg: int = 0, floor: float | None = None, floor_why: str = "",
             call: int | None = None, scalars: list | None = None, data_eps: float | None = None,
             root: bool = False, root_clamp: bool = False) -> list[Fix]:
    """Candidate fixes that change one operand of the culprit call (or of `call`) by an epsilon.

    Where the user's line is rewritten, the verification executes the rewritten operand exactly as shown
    (`change_code` applied to the operand's value) at every call of that expression; elsewhere `change` is
    an op-level patch at the culprit's call, and the fix is shown as guidance.

    `data_eps`, the smallest non-zero magnitude the operand takes in this batch, adds a last candidate
    at that scale: a tiny eps keeps the step finite but can make the values it produces at the edge
    (x / 1e-7) implausibly large; an eps at the scale of the data does not.

    `root`: where the operand's value is used by other ops too (a denominator two quotients share), the same
    change is first offered where that value is made — every use fixed at once — then at the culprit's call.
    """
    eps, why = choose_eps(s.dtype, scale, what, floor=floor, floor_why=floor_why, root_clamp=root_clamp)
    call = s.call if call is None else call
    fixes = []
    cands = eps_candidates(eps, why)
    d = finite_float(data_eps)
    if d and d > 0:
        d = float(f"{10.0 ** math.floor(math.log10(d)):.0e}")
        if d > cands[-1][0]:
            cands.append((d, f"eps = {fmt(d)}: the scale of the smallest non-zero value it changes in this batch "
                             f"({data_eps:.3g}), so the values made at the edge stay in the range of the others"))
    def made(e: float) -> tuple[codefix.Rewrite | None, dict | None]:
        rw = s.rewrite(codefix.with_operand(which, lambda t, e=e: change_code(t, e)), call, scalars=scalars)
        fn = operand_fn(rw) or (lambda t, e=e: change(t, e))
        return rw, s.at_calls(replace_arg(arg, fn), call, rw)
    shared = shared_root(s, arg) if root and call == s.call else None
    if shared is None and call == s.call and made(cands[0][0])[0] is None:
        shared = hidden_root(s, arg)  # the culprit runs inside a library call on the user's line
    if shared is not None:
        r, uses = shared
        at = _frame_at(r)

        def made_root(e: float):
            return root_fix_parts(s, r, lambda t, e=e: change_code(t, e), lambda t, e=e: change(t, e))
        compare = sorted({s.step.ops[i].call for i in uses if s.step.ops[i].call})
        for e, why in cands:
            rw, patch = made_root(e)
            also = f"; the value is used at {uses_where(s, uses)}: changed where it is made ({at}), every use is fixed"
            fixes.append(Fix(kind, "", epsilon=e, reasoning=why + also, rewrite=rw, patch=patch,
                             probe=made_root(e * 100)[1],
                             compare_at=[c for c0 in compare for c in (s.line_calls(c0) if rw else [c0])] or None,
                             guidance=f"{guidance(e)} where it is made ({at}): it is used at {uses_where(s, uses)}, "
                                      "and every use is fixed there"))
    for e, why in cands:
        rw, patch = made(e)
        fixes.append(Fix(kind, "", epsilon=e, reasoning=why, rewrite=rw, guidance=f"{guidance(e)} at {s.where}",
                         patch=patch, probe=made(e * 100)[1], probe_down=made(e / 100)[1]))
    return fixes


def _frame_at(rec: OpRecord) -> str:
    from nanreplay.replay import frame_json
    fr = frame_json(rec.frame)
    return f"{fr['file']}:{fr['line']}" if fr else "where it is computed"


def operand_fn(rw: codefix.Rewrite | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The changed operand of a rewrite as a function: the expression shown, executed on the operand's value."""
    return codefix.compile_operand(rw.operand) if rw is not None and rw.operand else None


def plus_eps(t: str, e: float) -> str:
    return codefix.plus(t, fmt(e))


def clamp_eps(t: str, e: float) -> str:
    return f"{codefix.paren(t)}.clamp_min({fmt(e)})"


HALF = ("float16", "bfloat16")


def nonneg_eps(s: Site, what: str) -> tuple[Callable[[str, float], str], Callable[[torch.Tensor, float], torch.Tensor],
                                              Callable[[float], str]]:
    """(code, change, words) of the ε for an operand that is never negative where the op is defined (sqrt's, log's,
    the base of a fractional power). In float32, `x + eps` (the goldens' form). In float16/bfloat16 an ε large
    enough to keep the gradient finite there is larger than the format's resolution at the healthy values
    (bfloat16 has 8 bits: 1 + 1e-2 is 1.0078), so `x + eps` moves every value; `x.clamp_min(eps)` leaves every
    value at or above eps exactly as it was and changes only the ones below it (their gradient is then 0)."""
    if s.dtype in HALF:
        return clamp_eps, (lambda t, e: t.clamp_min(e)), \
            (lambda e: f"clamp {what} at {fmt(e)} from below (in {s.dtype}, + {fmt(e)} would move every healthy "
                       "value by more than the format resolves)")
    return plus_eps, (lambda t, e: t + e), (lambda e: f"add {fmt(e)} to {what}")


# ------------------------------------------------------------------ root, not site: a value several ops share


def _uses(s: Site, fwd: int, depth: int = 0) -> list[int]:
    """The forward ops that use op `fwd`'s value, looking through views and copies of it."""
    out = []
    for i in s.consumers(fwd):
        r = s.step.ops[i]
        if depth < 4 and (getattr(r.op, "is_view", False) or packet(str(r.op)) in _PASS):
            out += _uses(s, i, depth + 1)
        else:
            out.append(i)
    return out


_PASS = ("aten.clone", "aten.contiguous", "aten.alias", "aten._to_copy", "aten.lift_fresh", "aten.expand",
         "aten.view", "aten.reshape", "aten.squeeze", "aten.unsqueeze")


def shared_root(s: Site, arg: int) -> tuple[OpRecord, list[int]] | None:
    """(the op that made the culprit's `arg`-th input, every op that uses its value) where that value is used by
    another op too (a denominator two quotients share, on consecutive lines): a change at the culprit's call
    leaves the others broken; a change where the value is made fixes them all."""
    r = s.origin(arg)
    if r is None or not r.call or s.event.fwd is None:
        return None
    uses = _uses(s, s.index(r))
    if len(uses) < 2 or s.event.fwd not in uses:
        return None
    return r, uses


def hidden_root(s: Site, arg: int) -> tuple[OpRecord, list[int]] | None:
    """(the op that made the culprit's `arg`-th input, every op that uses its value) where the culprit itself has
    no call on the user's line to rewrite (`nb.log_prob(x)` runs lgamma(total_count) inside torch.distributions)
    but that input was made by a call on another line of the user's (`theta = F.softplus(...)`): the change is
    made there, and so reaches every use of the value inside the library call."""
    r = s.origin(arg)
    if r is None or not r.call or s.event.fwd is None or not s.source:
        return None
    src = s.source_of(r.call)
    if not src or src.get("line") == s.source.get("line") or src.get("file") != s.source.get("file"):
        return None
    if s.rewrite(lambda text, node: text(node), r.call) is None:
        return None
    uses = _uses(s, s.index(r))
    return (r, uses) if s.event.fwd in uses else None


def root_fix_parts(s: Site, root: OpRecord, change_code: Callable[[str], str],
                   change: Callable[[torch.Tensor], torch.Tensor]) -> tuple[codefix.Rewrite | None, dict | None]:
    """The rewrite of the call that makes the shared value (`count = mask.sum()` -> `count =
    mask.sum().clamp_min(1)`) and its patch: the call's output changed exactly as the rewritten code shows, at
    every call that line makes (the recorded call alone where no line of the user's can be rewritten)."""
    rw = s.rewrite(lambda src, node: change_code(src(node)), root.call)
    fn = codefix.compile_operand(change_code(codefix.PLACEHOLDER)) if rw is not None else None
    fn = fn or change
    calls = s.line_calls(root.call) if rw is not None else [root.call]
    return rw, {c: (lambda func, args, kwargs: fn(func(*args, **kwargs))) for c in calls}


def uses_where(s: Site, uses: list[int]) -> str:
    """'fp.py:43, fp.py:44': the lines of the ops that use a shared value."""
    from nanreplay.replay import frame_json
    at = []
    for i in uses:
        fr = frame_json(s.step.ops[i].frame)
        if fr and f"{fr['file']}:{fr['line']}" not in at:
            at.append(f"{fr['file']}:{fr['line']}")
    return ", ".join(at)
