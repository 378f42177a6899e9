"""The no-op check, taken a chunk at a time and at the moved elements only (noop.NoOp.compare), counts and
judges every element as the whole-tensor check did: `_whole` below is that check as it was (one float64 copy
of each output, the reference and the conditioning over every element), and each case compares every field.
Element-wise float64 arithmetic on the same values on the same machine: the fields are equal, not close."""

from __future__ import annotations

import math

import pytest
import torch

from nanreplay import noop
from nanreplay.noop import REF_ULPS, NoOp, _conditioning, _own_inputs_f64, _tensors


def _whole(check: NoOp, name, got, want, call=None, func=None, args=(), kwargs=None, own=True):
    """The whole-tensor compare as it was before the chunked one (the reference every case is held to)."""
    outs_got, outs_want = _tensors(got), _tensors(want)
    if len(outs_got) != len(outs_want):
        return
    check.calls += 1
    refs = conds = None
    how = ""
    for i, (g, w) in enumerate(zip(outs_got, outs_want, strict=True)):
        if not (w.is_floating_point() and g.shape == w.shape):
            continue
        w64, g64 = w.detach().double(), g.detach().double()
        ok = torch.isfinite(w64)
        n = int(ok.sum())
        if not n:
            continue
        check.elements += n
        wf = torch.where(ok, w64, 0.0)
        scale = float(wf.abs().max())
        diff = torch.where(ok, (g64 - wf).abs(), 0.0)
        diff = torch.where(torch.isnan(diff), math.inf, diff)
        bad = diff > check.rtol * (wf.abs() + scale) + torch.finfo(w.dtype).eps
        if bool(bad.any()) and not how:
            refs = check.reference.at(call) if check.reference is not None and call is not None else None
            how = "the step"
            if (refs is None or len(refs) != len(outs_want)) and own:
                refs, how = _own_inputs_f64(func, args, kwargs), "the call on its own inputs"
            conds = _conditioning(func, args, kwargs) if own else None
        r = refs[i] if refs is not None and i < len(refs) else None
        if bool(bad.any()) and r is not None and r.is_floating_point() and r.shape == w.shape:
            r64 = r.detach().to(w64.device, torch.float64)
            fine = torch.isfinite(r64) & ok
            check.referenced += int(fine.sum())
            check.how = check.how or how
            err = torch.where(fine, (wf - r64).abs(), 0.0)
            tol = REF_ULPS * torch.finfo(w.dtype).eps * r64.abs()
            cond = conds[i] if conds is not None and i < len(conds) else None
            if cond is not None and cond.shape == w.shape:
                tol = tol + 2 * cond
            towards = fine & ((g64 - r64).abs() <= err + torch.where(fine, tol, 0.0))
            check.closer += int((bad & towards).sum())
            bad = bad & ~towards
        k = int(bad.sum())
        if k:
            check.changed += k
            rel = float(torch.where(bad, diff, 0.0).max()) / max(scale, torch.finfo(w.dtype).eps)
            if rel >= check.worst:
                check.worst, check.where = rel, name


class _Ref:
    def __init__(self, *values):
        self.values, self.asked = list(values), 0

    def at(self, call):
        self.asked += 1
        return self.values


FIELDS = ("calls", "elements", "changed", "worst", "where", "referenced", "closer", "how")


def _same(cases, monkeypatch, chunk) -> dict:
    monkeypatch.setattr(noop, "CHUNK", chunk)
    measured = []
    monkeypatch.setattr(noop, "_conditioning", lambda *a: measured.append(1) or _conditioning(*a))
    seen = {}
    for label, make_ref, kw in cases:
        new, old = NoOp(reference=make_ref()), NoOp(reference=make_ref())
        del measured[:]
        for c in kw:
            new.compare(**c)
            _whole(old, **c)
        got, want = {f: getattr(new, f) for f in FIELDS}, {f: getattr(old, f) for f in FIELDS}
        assert got == want, (label, got, want)
        assert new.sentence() == old.sentence()
        if isinstance(new.reference, _Ref):  # the reference is asked exactly where the whole check asked it
            assert new.reference.asked == old.reference.asked, label
        seen[label] = (got, len(measured))
    return seen


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g) * torch.tensor([[1.0], [20.0], [40.0], [60.0], [90.0], [5.0]])
    p = torch.softmax(x, -1)
    original = torch.log(p)  # -inf where p underflowed to 0, far from exact where it is subnormal
    exact = torch.log_softmax(x.double(), -1)
    fixed = torch.log_softmax(x, -1)
    away = torch.log(p + 1e-30)
    noisy = original.clone()
    noisy[0, :7] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e30, -1e-45])  # every kind of value
    holes = exact.clone()
    holes[3, ::5] = math.nan  # a reference that is itself not finite in places
    holes[4, 1::7] = -math.inf
    cos = torch.tensor([1.0, 1.0 - 2 ** -24, 0.99995, 0.9999, 0.99993] * 50, dtype=torch.float32)
    half = original.to(torch.float16)
    call = dict(name="log", call=7, func=torch.log, args=(p,))
    return [
        ("rounding only", lambda: None, [dict(name="log", got=fixed, want=original)]),
        ("the step's reference, towards", lambda: _Ref(exact), [dict(**call, got=fixed, want=original)]),
        ("the step's reference, away", lambda: _Ref(exact), [dict(**call, got=away, want=original)]),
        ("every kind of value", lambda: _Ref(exact), [dict(**call, got=noisy, want=original),
                                                      dict(**call, got=fixed, want=noisy)]),
        ("a reference with NaN and -inf", lambda: _Ref(holes), [dict(**call, got=away, want=original),
                                                                dict(**call, got=fixed, want=original)]),
        ("the call on its own inputs", lambda: None, [dict(**call, got=fixed, want=original)]),
        ("not its own inputs", lambda: None, [dict(**call, got=fixed, want=original, own=False)]),
        ("the conditioning answers", lambda: None,
         [dict(name="acos", got=torch.acos(cos.clamp(-1 + 6e-8, 1 - 6e-8)), want=torch.acos(cos), call=3,
               func=torch.acos, args=(cos,))]),
        ("the conditioning does not", lambda: None,
         [dict(name="acos", got=torch.acos(cos.clamp(-1 + 1e-4, 1 - 1e-4)), want=torch.acos(cos), call=3,
               func=torch.acos, args=(cos,))]),
        ("two outputs, a reference for both", lambda: _Ref(exact, exact * 2),
         [dict(name="pair", got=(fixed, away * 2), want=(original, original * 2), call=9)]),
        ("half precision", lambda: _Ref(exact), [dict(**call, got=fixed.to(torch.float16), want=half)]),
        ("a transposed output", lambda: _Ref(exact.t()), [dict(**call, got=fixed.t(), want=original.t())]),
    ]


@pytest.mark.parametrize("chunk", [1 << 20, 256, 7])
def test_the_chunked_check_is_the_whole_tensor_check(monkeypatch, chunk):
    seen = _same(_cases(), monkeypatch, chunk)
    # the cases reach every outcome: unchanged, moved towards the reference, moved away, by the step's
    # reference and by the call's own inputs, the conditioning deciding and not
    assert all(any(f[k] for f, _ in seen.values()) for k in ("changed", "closer", "referenced"))
    assert {f["how"] for f, _ in seen.values()} >= {"the step", "the call on its own inputs"}
    towards, cond = seen["the step's reference, towards"], seen["the conditioning answers"]
    assert towards[0]["closer"] and not towards[0]["changed"] and towards[1] == 0  # no conditioning measured
    assert cond[0]["closer"] and not cond[0]["changed"] and cond[1] == 1  # measured: it answers
    assert seen["the conditioning does not"][0]["changed"]
