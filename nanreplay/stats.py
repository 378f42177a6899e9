"""Small, exact summaries of tensors.

Records hold these summaries, never the tensors themselves. Every function here
is safe on any dtype (integer and bool tensors simply have no NaN or Inf) and
runs without building autograd graph.
"""

from __future__ import annotations

import math

import torch

from nanreplay.torch_internals import real_values


def _plain(t: torch.Tensor) -> torch.Tensor:
    """`t` as a dense tensor whose entries can be checked: a sparse one's values, a complex one's real and
    imaginary parts (a sparse embedding's or a complex parameter's gradient); any other tensor as it is."""
    return real_values(t) if t.layout is not torch.strided or t.is_complex() else t


def _count(mask: torch.Tensor) -> int:
    """Number of True elements (count_nonzero: several times faster than a bool sum)."""
    return int(torch.count_nonzero(mask))


@torch.no_grad()
def finite_fast(t: torch.Tensor) -> bool:
    """True when `t` holds no NaN and no Inf.

    One cheap reduction: a finite sum proves every element finite. Only when the
    sum is not finite (a NaN/Inf, or an overflow of huge finite values) do we
    pay for a second pass.
    """
    if not t.is_floating_point() or t.layout is not torch.strided:
        if not (t.is_complex() or t.layout is not torch.strided):
            return True
        t = _plain(t)
    if t.numel() == 0:
        return True
    if math.isfinite(t.sum().item()):
        return True
    return not any(kinds_slow(t))


@torch.no_grad()
def kinds_slow(t: torch.Tensor) -> tuple[bool, bool]:
    """(has_nan, has_inf) for a tensor whose sum was not finite, in one pass.

    aminmax propagates NaN, so it answers "any NaN?" and, without NaN, "any Inf?".
    With a NaN present has_inf is reported False: nothing downstream depends on
    Inf next to NaN (a NaN decides both the kind and the role), so we skip the pass.
    """
    t = _plain(t)
    lo, hi = (float(v) for v in torch.aminmax(t.reshape(-1)))
    if math.isnan(lo) or math.isnan(hi):
        return True, False
    return False, math.isinf(lo) or math.isinf(hi)


@torch.no_grad()
def kinds_after(t: torch.Tensor, total: float) -> tuple[bool, bool]:
    """(has_nan, has_inf), as `kinds_slow` answers them, for an output recorded past the failure's event (the
    replay's `Recorder.counted`: on no chain, so no report reads its kind or counts), whose sum `total` was not
    finite. A NaN sum is taken at its word, with no second pass: a NaN (or +Inf beside -Inf, or float32 values
    near its largest overflowing both ways: differences nothing downstream of such an event can show); an
    infinite sum, which finite values overflow more easily (a float16 sum past 65504), gets kinds_slow's pass."""
    if math.isnan(total):
        return True, False
    return kinds_slow(t)


@torch.no_grad()
def absmax(t: torch.Tensor) -> float | str:
    """max |x| in one pass (NaN when t holds a NaN)."""
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return _num(max(abs(float(lo)), abs(float(hi))))


@torch.no_grad()
def kinds(t: torch.Tensor) -> tuple[bool, bool]:
    """(has_nan, has_inf) of a tensor, exact."""
    t = _plain(t)
    if not t.is_floating_point() or t.numel() == 0 or math.isfinite(t.sum().item()):
        return False, False
    return kinds_slow(t)


@torch.no_grad()
def counts(t: torch.Tensor, known: tuple[bool, bool] | None = None, total: float | None = None) -> dict:
    """Output counts as in the JSON contract: numel, nan, posinf, neginf.

    `known` is (has_nan, has_inf) when the caller already checked (as kinds_slow
    reports it: has_inf is only meaningful without NaN); it spares the passes that
    cannot find anything. `total` is `t.sum()` when the caller has it: a sum of -Inf
    means no NaN and no +Inf (either would make it NaN or +Inf), so one pass counts
    the -Inf (an attention mask's common case); +Inf likewise.
    """
    out = {"numel": t.numel(), "nan": 0, "posinf": 0, "neginf": 0}
    t = _plain(t)
    if not t.is_floating_point():
        return out
    if total is not None and math.isinf(total):
        key, value = ("posinf", math.inf) if total > 0 else ("neginf", -math.inf)
        out[key] = _count(t == value)  # 0 where the sum overflowed on finite values
        return out
    if known is None:
        known = kinds(t)
    has_nan, has_inf = known
    if not (has_nan or has_inf):
        return out
    if has_nan:
        out["nan"] = _count(torch.isnan(t))
        if out["nan"] == out["numel"]:
            return out  # all NaN: no room for an Inf
        if out["nan"] and math.isfinite(torch.nansum(t).item()):
            return out  # the sum without the NaNs is finite: no Inf (one pass instead of two, no mask)
    if has_nan or has_inf:  # with NaN present, Inf was not looked for: count it
        inf = torch.isinf(t)
        n_inf = _count(inf)
        if n_inf:
            out["posinf"] = _count(inf & (t > 0))
            out["neginf"] = n_inf - out["posinf"]
    return out


def _num(x: float) -> float | str:
    """A float that survives strict JSON: non-finite values become strings."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


from nanreplay.numbers import NONFINITE_TEXT, num  # noqa: E402, F401 - torch-free: the report imports them too


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@torch.no_grad()
def tensor_stats(t: torch.Tensor) -> dict:
    """Input statistics as in the JSON contract, plus magnitudes for diagnosis.

    min/max are over the finite elements (None when there are none);
    `absmax` is the largest finite |x|, `absmin_nonzero` the smallest
    non-zero finite |x| — what an epsilon has to be compared with.
    """
    st: dict = {
        "shape": list(t.shape),
        "dtype": dtype_name(t.dtype),
        "min": None,
        "max": None,
        "zeros": 0,
        "negatives": 0,
        "nan": 0,
        "inf": 0,
        "absmax": None,
        "absmin_nonzero": None,
    }
    if t.numel() == 0 or t.dtype == torch.bool or t.is_complex():
        return st
    t, reps = distinct(t)  # a broadcast input (a sum's gradient expanded 8-fold): each distinct element once
    st["zeros"] = _count(t == 0) * reps
    st["negatives"] = _count(t < 0) * reps
    if not t.is_floating_point():
        st["min"], st["max"] = int(t.min()), int(t.max())
        a = t.abs()
        st["absmax"] = int(a.max())
        nz = a[a != 0]
        st["absmin_nonzero"] = int(nz.min()) if nz.numel() else None
        return st
    if math.isfinite(t.sum().item()):  # no NaN, no Inf: one pass instead of two masks and their counts
        fin = t.reshape(-1)
    else:
        nan = torch.isnan(t)
        inf = torch.isinf(t)
        st["nan"] = _count(nan) * reps
        st["inf"] = _count(inf) * reps
        fin = t[~(nan | inf)] if (st["nan"] or st["inf"]) else t.reshape(-1)
    if fin.numel():
        lo, hi = float(fin.min()), float(fin.max())
        st["min"], st["max"] = lo, hi
        st["absmax"] = max(abs(lo), abs(hi))  # the largest |x| is at an end of the range
        # the smallest non-zero |x| without compacting the non-zeros into a copy (fin is finite: inf is never it)
        small = float(torch.where(fin != 0, fin.abs(), math.inf).min())
        st["absmin_nonzero"] = small if small != math.inf else None
    return st


def distinct(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`t` with each broadcast dimension (stride 0, size > 1: one element seen `size` times) narrowed to one, and
    how many times each remaining element stands in `t`: counts over `t` are counts over it times that, and its
    range is `t`'s. An expanded 16x256x256x8 view of a 16x256x256 tensor is read as 1M elements, not 8M."""
    reps = 1
    for d, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True)):
        if s == 0 and n > 1:
            t = t.narrow(d, 0, 1)
            reps *= n
    return t, reps


def _mean_std(x: torch.Tensor, big: float, skip: torch.Tensor | None = None, n: int | None = None
              ) -> tuple[float, float | None]:
    """Mean and std (n - 1) of `x`'s elements, or of those not in the mask `skip` (`x` holding 0 there; `n`: how
    many are not), `big` their largest |x|, in two passes (the sum, then the squared deviations, scaled by `big`
    so that neither tiny nor large values under- or overflow their squares: as exact as a Welford pass and
    faster on the CPU). float32 stays float32 below 1e15 (its deviations cannot overflow); the rest in float64."""
    if x.dtype != torch.float64 and (x.dtype != torch.float32 or big >= 1e15):
        x = x.double()
    n = x.numel() if n is None else n
    m = x.sum() / n
    if n < 2:
        return float(m), None
    if big == 0:
        return float(m), 0.0
    d = (x - m).mul_(1.0 / big)
    if skip is not None:
        d.masked_fill_(skip, 0.0)
    return float(m), big * math.sqrt(float(d.square_().sum()) / (n - 1))


@torch.no_grad()
def grad_stats(name: str, p: torch.Tensor) -> dict:
    """The per-parameter walk of "Debugging Gradients That Misbehave": mean, std, max |g|, NaN?, Inf? (or NO GRADIENT).

    mean/std/max_abs are over every element (NaN as soon as one is NaN); the `finite_*`
    fields are over the finite elements only, so a gradient that is partly NaN still says
    what the rest of it looks like. A std needs two values: null below that.
    """
    g = p.grad
    row: dict = {"name": name, "shape": list(p.shape), "dtype": dtype_name(p.dtype), "has_grad": g is not None,
                 "numel": p.numel()}
    if g is None:
        row.update(mean=None, std=None, max_abs=None, nan=0, inf=0, grad_shape=None, finite=0, finite_mean=None,
                   finite_std=None, finite_max_abs=None)
        return row
    gd = _plain(g.detach())
    n = gd.numel()
    if not gd.is_floating_point():
        gd = gd.double()
    if n > 1:
        # the common case: the range first (aminmax propagates NaN and shows ±Inf, so a finite range is the
        # finiteness check), then the mean and the std (float64 where the values are large enough for float32's
        # sums of squares to overflow)
        lo, hi = (float(v) for v in torch.aminmax(gd.reshape(-1)))
        if math.isfinite(lo) and math.isfinite(hi):
            big = max(abs(lo), abs(hi))
            mean, std = _mean_std(gd, big)
            row.update(mean=mean, std=std, max_abs=big, nan=0, inf=0, grad_shape=list(g.shape), finite=n,
                       finite_mean=mean, finite_std=std, finite_max_abs=big)
            return row
    row.update(nan=0, inf=0, grad_shape=list(g.shape), finite=0, finite_mean=None, finite_std=None,
               finite_max_abs=None)  # (the contract's key order)
    # NaN/Inf somewhere: the whole-tensor mean/std/max follow from the counts (a NaN makes all three NaN; Inf
    # without NaN makes max |g| Inf, the std NaN, the mean ±Inf or NaN), so only the finite elements are reduced
    nan_at = torch.isnan(gd)
    nan = _count(nan_at)
    if nan and nan < n:  # NaN and perhaps nothing else: the finite part with NaN read as 0, if no Inf is left
        z = gd.masked_fill(nan_at, 0.0)
        lo, hi = (float(v) for v in torch.aminmax(z.reshape(-1)))
        if math.isfinite(lo) and math.isfinite(hi):
            finite = n - nan
            big = max(abs(lo), abs(hi))
            mean, std = _mean_std(z, big, nan_at, finite)
            row.update(nan=nan, inf=0, finite=finite, finite_max_abs=big, finite_mean=mean,
                       finite_std=std, mean="nan", std="nan", max_abs="nan")
            return row
        del z
    ok = torch.isfinite(gd) if nan < n else None  # (all NaN: nothing finite, no Inf)
    finite = _count(ok) if ok is not None else 0
    inf = n - finite - nan
    if nan:
        mean = std = big = "nan"
    elif inf:
        pos = _count(gd == math.inf)
        mean = "inf" if pos == inf else "-inf" if pos == 0 else "nan"
        std, big = "nan", "inf"
    row.update(nan=nan, inf=inf, finite=finite)
    if finite:
        fin = (gd[ok] if finite < n else gd.reshape(-1)).double()
        lo, hi = (float(v) for v in torch.aminmax(fin))
        row["finite_max_abs"] = max(abs(lo), abs(hi))
        row["finite_mean"], row["finite_std"] = _mean_std(fin, row["finite_max_abs"])
    if not (nan or inf):  # one element (n == 1), finite: the finite figures are the figures
        mean, std, big = row["finite_mean"], row["finite_std"], row["finite_max_abs"]
    row.update(mean=mean if n else None, std=std if n > 1 else None, max_abs=big if n else 0.0)
    return row


def leaf_counts(t: torch.Tensor) -> tuple[int, int]:
    """(nan, inf) element counts; zero for non-float tensors."""
    c = counts(t)
    return c["nan"], c["posinf"] + c["neginf"]


def mask_values(t: torch.Tensor) -> bool:
    """Only -inf among its non-finite values (no NaN, no +inf): an additive attention mask's values, a literal-like
    source whose effect the causal chain judges (softmax over a row where every key is masked), not damage."""
    c = counts(t)
    return c["neginf"] > 0 and not c["nan"] and not c["posinf"]


def leaf_row(name: str, role: str, t: torch.Tensor, *, shape: torch.Size | None = None) -> dict | None:
    """A non-finite-leaves row ({name, role, nan, inf, shape}) for a tensor holding NaN/Inf, else None.
    `shape`: the shape to report where `t` is a selection of the tensor."""
    nan, inf = leaf_counts(t)
    if not (nan or inf):
        return None
    return {"name": name, "role": role, "nan": nan, "inf": inf, "shape": list(t.shape if shape is None else shape)}


def jsonable(x):
    """Deep-convert to strict-JSON values: the one rule for the whole analysis JSON (docs/json.md).

    A NaN or an infinite number is written as the string "nan", "inf" or "-inf"; null
    always means "no value" (not measured, not applicable), never a non-finite number.
    """
    if isinstance(x, float):
        return _num(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return jsonable(x.tolist())
    return x
