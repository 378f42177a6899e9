"""One rule for numbers in the analysis JSON (docs/json.md): a non-finite number is the string "nan", "inf" or
"-inf"; null means "no value" and never stands for a non-finite number."""

from __future__ import annotations

import json
import math

import pytest

from nanreplay import stats
from nanreplay.analysis import analyze
from samples import SAMPLES, flags

NONFINITE = {"nan", "inf", "-inf"}
# every field that holds a measured number, as a path with [] for "each element"
NUMERIC = [
    "loss", "snapshot_info.loss_value", "snapshot_info.grad_norm", "snapshot_info.history[].loss",
    "snapshot_info.history[].grad_norm", "gradients[].mean", "gradients[].std", "gradients[].max_abs",
    "gradients[].finite_mean", "gradients[].finite_std", "gradients[].finite_max_abs", "activations[].absmax",
    "activations[].ratio", "precision[].loss", "culprit.inputs[].min", "culprit.inputs[].max",
    "culprit.inputs[].absmax", "culprit.inputs[].absmin_nonzero", "culprit.forward_inputs[].min",
    "culprit.forward_inputs[].max", "diagnosis.fix.epsilon",
]

_cache: dict[str, dict] = {}


def analysis(name: str) -> dict:
    if name not in _cache:
        _cache[name] = analyze(SAMPLES / f"{name}.pt", **flags(name)).to_json()
    return _cache[name]


def values(d, path: str) -> list:
    """Every value at `path` ('a.b[].c') in `d`; missing keys and null parents give nothing."""
    out = [d]
    for part in path.split("."):
        nxt = []
        for x in out:
            key, each = (part[:-2], True) if part.endswith("[]") else (part, False)
            v = x.get(key) if isinstance(x, dict) else None
            if v is None:
                if not each and isinstance(x, dict) and key in x:
                    nxt.append(None)
                continue
            nxt.extend(v if each else [v])
        out = nxt
    return out


@pytest.mark.parametrize("name", ["fp16_overflow", "sqrt_zero", "log_zero"])
def test_numbers_are_numbers_or_one_of_three_words_and_null_is_no_value(name):
    d = analysis(name)
    json.dumps(d, allow_nan=False)  # strict JSON: no NaN/Infinity tokens anywhere
    seen_words = set()
    for path in NUMERIC:
        for v in values(d, path):
            assert v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)) \
                or v in NONFINITE, (path, v)
            if isinstance(v, str):
                seen_words.add(v)
    assert seen_words, "each of these samples has a non-finite number somewhere"
    for v in values(d, "culprit.inputs[]"):  # min/max are over finite values: null only where there are none
        if v["min"] is None:
            assert v["nan"] + v["inf"] == math.prod(v["shape"])


def test_a_nonfinite_value_is_never_written_as_null():
    d = analysis("fp16_overflow")
    bad = [r for r in d["activations"] if r["absmax"] in NONFINITE]
    assert bad and all(r["ratio"] == r["absmax"] for r in bad)  # was null before the rule
    assert all(r["near_overflow"] for r in bad if r["absmax"] == "inf")
    assert d["loss"] in NONFINITE
    for g in d["gradients"]:
        numel = math.prod(g["shape"])
        if g["nan"]:
            assert g["mean"] == "nan" and (g["std"] == "nan" or numel < 2)
        # finite statistics: a number when there are finite values, null (no value) when there are none
        assert g["finite"] == numel - g["nan"] - g["inf"]
        assert (g["finite_mean"] is None) == (g["finite"] == 0)
        assert (g["finite_std"] is None) == (g["finite"] < 2)
        if numel < 2:
            assert g["std"] is None  # a std of one value has no value; it is not 0
    one = [g for g in d["gradients"] if math.prod(g["shape"]) == 1]
    assert one, "the fp16 sample has a one-element gradient (head.bias)"


def test_jsonable_applies_the_rule_deeply():
    import torch

    x = {"a": math.nan, "b": [math.inf, -math.inf, 1.5, None], "c": (2, {"d": float("nan")}),
         "t": torch.tensor([1.0, math.inf])}
    assert stats.jsonable(x) == {"a": "nan", "b": ["inf", "-inf", 1.5, None], "c": [2, {"d": "nan"}],
                                 "t": [1.0, "inf"]}
    assert [float(v) for v in ("nan", "inf", "-inf")][1:] == [math.inf, -math.inf]  # how readers get them back


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_event_counts_are_exact_for_every_mix_of_nan_and_inf(dtype):
    """The recorder's counts take shortcuts (all NaN; NaN with a finite rest; a sum of ±Inf, which rules out
    NaN and the other Inf, or was an overflow of finite values); each must give the exact answer."""
    import torch

    big = torch.finfo(getattr(torch, dtype)).max
    nan, inf = math.nan, math.inf
    for values in ([1.0, nan, inf, -inf], [nan] * 3, [1.0, nan], [inf, 2.0], [big, big, nan], [inf, -inf, nan],
                   [1.0, 2.0], [big, big], [-inf, nan, nan, 5.0], [big, -big, inf], [-inf, -inf, 1.0],
                   [-big, -big, -inf], [-big, -big], [inf, big, inf]):
        t = torch.tensor(values).to(getattr(torch, dtype))
        want = {"numel": len(values), "nan": sum(math.isnan(v) for v in values),
                "posinf": sum(v == inf for v in values), "neginf": sum(v == -inf for v in values)}
        assert stats.counts(t, (True, True)) == want, values
        assert stats.counts(t) == want, values
        assert stats.counts(t, (True, True), t.sum().item()) == want, values  # the recorder passes the sum


def _grad_stats_reference(values: list[float]) -> dict:
    """grad_stats written the plain way: every figure in float64 over the whole tensor and over its finite part."""
    import torch

    g = torch.tensor(values, dtype=torch.float64)
    fin = g[torch.isfinite(g)]
    return {"nan": int(torch.isnan(g).sum()), "inf": int(torch.isinf(g).sum()), "finite": fin.numel(),
            "mean": stats._num(g.mean()) if g.numel() else None, "std": stats._num(g.std()) if g.numel() > 1 else None,
            "max_abs": stats._num(g.abs().max()) if g.numel() else 0.0,
            "finite_mean": float(fin.mean()) if fin.numel() else None,
            "finite_std": float(fin.std()) if fin.numel() > 1 else None,
            "finite_max_abs": float(fin.abs().max()) if fin.numel() else None}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_grad_stats_of_nonfinite_gradients_equal_the_plain_float64_figures(dtype):
    """grad_stats takes the whole-tensor figures of a non-finite gradient from its counts (a NaN makes mean, std
    and max |g| NaN; Inf alone makes max |g| Inf, the std NaN and the mean ±Inf, or NaN for both signs) and
    reduces only the finite part: each mix must give what the plain float64 computation gives."""
    import torch

    big = torch.finfo(getattr(torch, dtype)).max
    nan, inf = math.nan, math.inf
    for values in ([1.0, nan, inf, -inf], [nan] * 3, [1.0, nan], [inf, 2.0], [big, big, nan], [inf, -inf, nan],
                   [-inf, -3.0, 1.0], [inf, inf], [-inf], [nan], [3.5], [big, big], [-big, -big, 2.0],
                   [0.25, -inf, nan, 5.0, 7.0]):
        t = torch.tensor(values).to(getattr(torch, dtype))
        p = torch.nn.Parameter(torch.zeros_like(t))
        p.grad = t
        got = stats.grad_stats("w", p)
        want = _grad_stats_reference([float(v) for v in t])
        for k, v in want.items():  # float64 sums in another order: the last bit may differ
            assert got[k] == (pytest.approx(v, rel=1e-12) if isinstance(v, float) else v), (values, k)
        assert got["numel"] == len(values) and got["grad_shape"] == [len(values)]


def test_input_statistics_of_a_broadcast_view_are_those_of_its_copy():
    """tensor_stats reads a broadcast input (stride 0: a sum's gradient expanded) once per distinct element and
    scales its counts: every field must be what the same values, materialized, give."""
    import torch

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.float64, torch.int64):
        x = (torch.randn(5, 7, 3, generator=g) * 3).to(dtype)
        if dtype.is_floating_point:
            x[0, 0, 0], x[1, 2, 0], x[2, 1, 1], x[3, 3, 2] = float("nan"), float("inf"), 0.0, -0.0
        for view in (x[:, :1].expand(5, 7, 3), x[:1, :, None].expand(4, 7, 6, 3), x[..., :1].expand(5, 7, 9),
                     torch.zeros(3, 1, dtype=dtype).expand(3, 5), x.transpose(0, 2)):
            assert stats.tensor_stats(view) == stats.tensor_stats(view.contiguous()), (dtype, view.shape)
    nan = torch.full((3, 1), float("nan")).expand(3, 4)
    assert stats.tensor_stats(nan) == stats.tensor_stats(nan.contiguous())
    assert stats.tensor_stats(nan)["nan"] == 12 and stats.tensor_stats(nan)["min"] is None
