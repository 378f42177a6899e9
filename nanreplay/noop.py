"""Is a fix a no-op where the original was fine? (docs/fix-verification.md)

At every patched call the original call runs too, on the same inputs, and `NoOp` compares the two outputs where
the original was finite: by rounding, and against the step's own float64 values (`Float64Reference`, one forward
per analysis), with the op's conditioning at its inputs as the tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nanreplay import replay
from nanreplay.limits import release_memory
from nanreplay.replay.recorder import value_outputs
from nanreplay.replay.subject import Subject

NOOP_RTOL = 1e-3  # "within rounding": no finite value of the original moves by more than this share of its scale


def working_rtol(subject: Subject) -> float:
    """The no-op tolerance of this step: NOOP_RTOL, or the resolution of the precision the step computes in
    where that is coarser (bf16 autocast, half weights). An ε the epsilon policy sized to one bf16 rounding
    step moves a float32 rsqrt under bf16 autocast by ~0.6%: within the step's own rounding, not a change."""
    dts = [subject.step_dtype(), (subject.autocast or {}).get("dtype")]
    return max([NOOP_RTOL] + [torch.finfo(d).eps for d in dts if isinstance(d, torch.dtype) and d.is_floating_point])


class Float64Reference:
    """The step's own values at the calls a no-op check compares, computed in float64 (autocast off): one forward
    under no_grad, made once per analysis (the first time a candidate needs it) for every call any candidate
    patches or compares at, and only those outputs kept. Missing (None) where the float64 step cannot run or
    makes a call differently (another function, another shape): the check then falls back to each call's own
    inputs in float64."""

    def __init__(self, subject: Subject, calls: set[int], names: list[str] | None = None):
        self.subject, self.calls, self.names = subject, set(calls), names
        self._values: dict[int, tuple[str, object]] | None = None

    @property
    def made(self) -> bool:
        return self._values is not None

    def at(self, c: int) -> list[torch.Tensor] | None:
        if self._values is None:
            self._values = {}
            if self.calls:
                try:
                    s = self.subject
                    variant = s.converted(torch.float64, None if s.autocast else "same")
                    for q in variant.model.parameters():  # no graph is kept (grad mode stays on: a step program
                        q.requires_grad_(False)           # numbers its calls with it), one activation at a time
                    default = torch.get_default_dtype()
                    torch.set_default_dtype(torch.float64)  # the step's own torch.zeros(...) in float64 too
                    try:  # made in the middle of a fix's replay, from the step's start to the last call it keeps:
                        with torch.random.fork_rng(devices=_cuda(s)):  # its random draws are not the fix's
                            self._values = replay.outputs_at(variant, self.calls)
                    finally:
                        torch.set_default_dtype(default)
                    del variant
                except Exception:  # noqa: BLE001 - no reference: the check falls back to each call's inputs
                    self._values = {}
                release_memory()
        got = self._values.get(c)
        if got is None:
            return None
        name, out = got
        if self.names is not None and 0 <= c < len(self.names) and self.names[c] and name != self.names[c]:
            return None  # the float64 step made another call at this number: not a reference for this one
        return _tensors(out)


def _cuda(subject: Subject) -> list[int]:
    """The CUDA device whose RNG a replay of `subject` draws from (besides the CPU's), for `fork_rng`."""
    dev = torch.device(subject.device or "cpu") if isinstance(subject.device, (str, torch.device)) else None
    return [dev.index or 0] if dev is not None and dev.type == "cuda" else []


class Deferred:
    """Stands in for the `Float64Reference` of a replay whose no-op check may never be read (the ε × 100 probe:
    its check decides something only where its loss and the candidate's disagree): asked for a value, it gives
    none and remembers it was asked. A check that never asked is exactly the check the reference would have made
    (it is asked only where rounding alone does not answer); one that asked is not, and is made again against the
    reference where it is read (diagnose/engine.py)."""

    def __init__(self):
        self.asked = False

    def at(self, c: int) -> None:
        self.asked = True
        return None


REF_ULPS = 4  # the rounding one op adds to a value, in units of its working precision, beside its input's error


@dataclass
class NoOp:
    """Is a fix a no-op where the original was fine? At every patched call the original call runs too (on the
    same inputs, without gradients) and the two outputs are compared on every element where the original was
    finite. An element is unchanged when it moved by no more than rounding: |patched - original| ≤ rtol ×
    (|original| + the original's largest finite magnitude) + the dtype's eps (rtol: NOOP_RTOL, or the step's
    working precision where coarser: `working_rtol`) — or by no more than the original's own error there: the
    patched value is no farther from the float64 reference (`Float64Reference`: the same step in float64; else
    the call on its own inputs in float64) than the original was, give or take the op's conditioning (how far
    its float64 value moves when its inputs move by one step of their own precision) and a few roundings of the
    working precision. A fix that moves values towards the exact value is never "not a no-op"."""
    rtol: float = NOOP_RTOL
    calls: int = 0  # patched calls compared
    elements: int = 0  # elements where the original was finite
    changed: int = 0  # of those, how many the fix moved beyond rounding and beyond the original's own error
    worst: float = 0.0  # the largest move, relative to the output's scale
    where: str = ""  # the call that moved most
    seen: set = field(default_factory=set)  # call numbers compared
    reference: Float64Reference | Deferred | None = None
    referenced: int = 0  # elements judged against a float64 value of the step
    closer: int = 0  # elements the fix moved beyond rounding, but towards the float64 value (within its error)
    how: str = ""  # "the step in float64" | "each call's own inputs in float64"
    total: int = 0  # elements compared, finite or not
    faulting: int = 0  # finite values left out: the original's derivative there was not finite (its gradient broke)
    pending: list = field(default_factory=list)  # moves to weigh against the derivative, after the replay (`settle`)

    @property
    def ok(self) -> bool:
        self.settle()
        return self.changed == 0

    def sentence(self) -> str:
        self.settle()
        ref = ""
        if self.closer:
            ref = (f"; {self.closer} moved beyond that, but no farther from a float64 replay of {self.how} than the "
                   f"original's own error there")
        if self.faulting:
            ref += (f"; {self.faulting} finite value{'s' if self.faulting != 1 else ''} where the original's "
                    "derivative was not finite (where its gradient broke) left out")
        if self.ok and not self.elements:
            return (f"a no-op where the original was fine: it was fine nowhere at the {self.calls} patched "
                    f"call{'s' if self.calls != 1 else ''}{ref}")
        if self.ok:
            return (f"a no-op where the original was fine ({self.elements} finite values at {self.calls} patched "
                    f"call{'s' if self.calls != 1 else ''} unchanged within {self.rtol:g} of their scale{ref})")
        against = f", and farther from a float64 replay of {self.how} than the original's own error" \
            if self.referenced else ""
        return (f"changes values the original computed fine: {self.changed} of {self.elements} finite values at "
                f"the patched calls moved by up to {self.worst:.3g} of their scale{against} ({self.where})")

    def compare(self, name: str, got, want, call: int | None = None, func=None, args=(), kwargs=None,
                own: bool = True) -> None:
        """`own`: `args` are the inputs the original call had, so the call on them in float64 is a reference
        where the step's float64 value is missing (not so where a rewritten expression ends: `compare_at`).

        Element by element as `_moved` and `_towards` say; the move by rounding is taken a chunk at a time
        (CHUNK elements in float64, not two whole outputs), and the reference, its conditioning and the
        original's own error only at the elements that moved beyond rounding (the others are unchanged whatever
        the reference says). The conditioning is measured only where an element is not already no farther
        from the reference without it (it only widens the tolerance)."""
        outs_got = _tensors(got)
        outs_want = _tensors(want)
        keep = value_outputs(func) if func is not None else None  # not a workspace (aten._ctc_loss's log_alpha)
        if keep:
            outs_got, outs_want = outs_got[:keep], outs_want[:keep]
        if len(outs_got) != len(outs_want):
            return
        self.calls += 1
        refs = conds = None
        how = ""
        asked = False
        for i, (g, w) in enumerate(zip(outs_got, outs_want, strict=True)):
            if not (w.is_floating_point() and g.shape == w.shape):
                continue
            shape = w.shape
            g, w = g.detach().reshape(-1), w.detach().reshape(-1)
            ok = torch.isfinite(w)
            n = int(ok.sum())
            self.total += w.numel()
            if not n:
                continue
            self.elements += n
            scale = float(torch.where(ok, w, 0).abs().max())  # exact in any float dtype
            eps = torch.finfo(w.dtype).eps
            at, diff = _moved(g, w, ok, scale, self.rtol, eps)
            if not at.numel():
                continue
            if not how:  # only where rounding alone does not answer: the reference, once
                refs = self.reference.at(call) if self.reference is not None and call is not None else None
                how = "the step"
                if (refs is None or len(refs) != len(outs_want)) and own:
                    refs, how = _own_inputs_f64(func, args, kwargs), "the call on its own inputs"
                asked = own
            r = refs[i] if refs is not None and i < len(refs) else None
            still = torch.ones_like(at, dtype=torch.bool)  # moved beyond rounding and not towards the reference
            if r is not None and r.is_floating_point() and r.shape == shape:
                r64 = r.detach().reshape(-1).to(w.device, torch.float64)
                self.referenced += int((torch.isfinite(r64) & ok).sum())
                self.how = self.how or how
                g_at, w_at, r_at = g[at].double(), w[at].double(), r64[at]
                towards = _towards(g_at, w_at, r_at, eps, None)
                if not bool(towards.all()):  # the op's conditioning may yet answer: measured once per call
                    if asked:
                        conds, asked = _conditioning(func, args, kwargs), False
                    cond = conds[i] if conds is not None and i < len(conds) else None
                    if cond is not None and cond.shape == shape:
                        towards = _towards(g_at, w_at, r_at, eps, cond.reshape(-1)[at])
                self.closer += int(towards.sum())
                still = ~towards
            at, diff = at[still], diff[still]
            if own and at.numel() and _pointwise(func) and sum(_numel(a) for a in args) <= COND_LIMIT:
                # an element whose output was finite but whose derivative was not is where the original broke
                # (sqrt(0), acosh(1): its gradient is NaN/Inf), not where it was fine: weighed after the replay,
                # where autograd runs (inside a dispatch mode it does not)
                self.pending.append((name, func, [_kept(a) for a in args], dict(kwargs or {}), i, shape, at, diff,
                                     scale, eps))
                continue
            self._count(name, diff, scale, eps)

    def _count(self, name: str, moves: torch.Tensor, scale: float, eps: float) -> None:
        k = moves.numel()
        if k:
            self.changed += k
            rel = float(moves.max()) / max(scale, eps)
            if rel >= self.worst:
                self.worst, self.where = rel, name

    def settle(self) -> None:
        """Weigh the pending moves: the elements where the original's derivative was not finite are left out."""
        while self.pending:
            name, func, args, kwargs, i, shape, at, moves, scale, eps = self.pending.pop(0)
            broken = _broken_derivative(func, args, kwargs, i, shape)
            if broken is not None:
                hit = broken.reshape(-1)[at.to(broken.device)].to(at.device)
                n = int(hit.sum())
                self.faulting += n
                self.elements -= n
                moves = moves[~hit]
            self._count(name, moves, scale, eps)


def _pointwise(func) -> bool:
    return func is not None and torch.Tag.pointwise in getattr(func, "tags", ())


def _numel(a) -> int:
    return a.numel() if isinstance(a, torch.Tensor) else 0


def _kept(a):
    return a.detach().clone() if isinstance(a, torch.Tensor) else a


def _broken_derivative(func, args: list, kwargs: dict, i: int, shape) -> torch.Tensor | None:
    """Where the derivative of the call's i-th output with respect to an input of its own shape is not finite
    (NaN/Inf), at the inputs the original call had (a boolean mask of that shape); None where that cannot be
    measured."""
    shape = tuple(shape)
    floats = [j for j, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()
              and tuple(a.shape) == shape]
    if not floats:
        return None
    try:
        with torch.enable_grad():
            leaves = list(args)
            for j in floats:
                leaves[j] = args[j].detach().clone().requires_grad_(True)
            outs = _tensors(func(*leaves, **kwargs))
            if i >= len(outs) or not outs[i].requires_grad or tuple(outs[i].shape) != shape:
                return None
            grads = torch.autograd.grad(outs[i], [leaves[j] for j in floats], torch.ones_like(outs[i]),
                                        allow_unused=True)
    except Exception:  # noqa: BLE001 - an op without a derivative here: its moves count as they are
        return None
    broken = torch.zeros(shape, dtype=torch.bool, device=outs[i].device)
    for g in grads:
        if g is not None:
            broken |= ~torch.isfinite(g.detach()).to(broken.device)
    return broken


CHUNK = 1 << 20  # elements per float64 chunk of the rounding test


def _moved(g: torch.Tensor, w: torch.Tensor, ok: torch.Tensor, scale: float, rtol: float, eps: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (flat) elements where the original `w` was finite and the patched `g` moved by more than rounding:
    |g - w| > rtol × (|w| + scale) + eps, in float64; with their moves (a finite value made NaN moved infinitely)."""
    at, moves = [], []
    for s in range(0, w.numel(), CHUNK):
        okc = ok[s:s + CHUNK]
        wf = torch.where(okc, w[s:s + CHUNK].double(), 0.0)
        diff = torch.where(okc, (g[s:s + CHUNK].double() - wf).abs(), 0.0)
        diff = torch.where(torch.isnan(diff), math.inf, diff)
        # plus the dtype's resolution at 1: log(p) of a p that rounded to 1 is 0, the exact form's -1e-17 is not
        idx = torch.nonzero(diff > rtol * (wf.abs() + scale) + eps).reshape(-1)
        if idx.numel():
            at.append(idx + s)
            moves.append(diff[idx])
    if not at:
        return torch.zeros(0, dtype=torch.long, device=w.device), torch.zeros(0, dtype=torch.float64, device=w.device)
    return torch.cat(at), torch.cat(moves)


def _towards(g: torch.Tensor, w: torch.Tensor, r: torch.Tensor, eps: float, cond: torch.Tensor | None) -> torch.Tensor:
    """Moved no farther from the float64 reference `r` than the original `w` was (its own error there), give or
    take a few roundings of the working precision and, where measured, twice the op's conditioning (its inputs
    are known to their last bit, and rounded once more upstream): float64, at the elements given."""
    fine = torch.isfinite(r)
    err = torch.where(fine, (w - r).abs(), 0.0)
    tol = REF_ULPS * eps * r.abs()
    if cond is not None:
        tol = tol + 2 * cond
    return fine & ((g - r).abs() <= err + torch.where(fine, tol, 0.0))


def _up(a):
    return a.detach().double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


def _own_inputs_f64(func, args, kwargs) -> list[torch.Tensor] | None:
    """The call on its own inputs, each float tensor in float64: the op's exact value at the inputs it got."""
    if func is None:
        return None
    try:
        with torch.no_grad():
            return _tensors(func(*[_up(a) for a in args], **{k: _up(v) for k, v in (kwargs or {}).items()}))
    except Exception:  # noqa: BLE001 - an op without a float64 kernel: judged by rounding alone
        return None


COND_LIMIT = 1 << 22  # elements: beyond this the conditioning is not measured (the check stays by rounding)


def _conditioning(func, args, kwargs) -> list[torch.Tensor] | None:
    """How far the call's float64 value moves when one of its float inputs moves by one step of its own dtype
    (up or down, each input in turn): the op's conditioning at these inputs. acos at x = 1.0 moves by 3.5e-4
    when x moves to the float32 below 1: a clamp that moves it by that much changes nothing the input knew."""
    floats = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if func is None or not floats or len(floats) > 3 or any(args[i].numel() > COND_LIMIT for i in floats):
        return None
    kwargs = kwargs or {}
    try:
        with torch.no_grad():
            base = _tensors(func(*[_up(a) for a in args], **{k: _up(v) for k, v in kwargs.items()}))
            worst = [torch.zeros_like(b, dtype=torch.float64) if b.is_floating_point() else None for b in base]
            for i in floats:
                a = args[i].detach()
                for to in (math.inf, -math.inf):
                    moved = list(args)
                    moved[i] = torch.nextafter(a, torch.full_like(a, to))
                    outs = _tensors(func(*[_up(x) for x in moved], **{k: _up(v) for k, v in kwargs.items()}))
                    for j, (o, b) in enumerate(zip(outs, base, strict=False)):
                        if worst[j] is None or o.shape != b.shape:
                            continue
                        d = (o.double() - b.double()).abs()
                        worst[j] = torch.maximum(worst[j], torch.where(torch.isfinite(d), d, 0.0))
    except Exception:  # noqa: BLE001 - not measurable here: the check goes by rounding and the reference alone
        return None
    return worst


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []
