"""The table of fused / backend-specific kernels and their reference compositions: op → reference → fix.

One `Row` per kernel. Its `compose` computes the kernel's outputs from the kernel's own arguments with the
reference composition (the math SDPA, torch's decomposition of a fused norm, the LSTM cell written out), in
whatever dtype those arguments have; outputs it does not compute (a logsumexp, a oneDNN workspace) are zeros
of the kernel's own shapes when the reference stands in for the kernel in a whole step. `fix` is what the user
writes to get the reference in their own code; `user_context` does it for a replay of the user's own model
(a step program calls the recorded kernel by name, so there `Substituted` stands in for it).

A new kernel is one row here; tests/differential/test_kernel.py runs every row's `example` against its
kernel. Used by differential/kernel.py (the kernel's question) and verify.py (the precision probe replays a
kernel without a float64 kernel, `float64_kernel=False`, as its reference in float64).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nanreplay import torch_internals as ti

aten = torch.ops.aten


@dataclass(frozen=True)
class Row:
    op: str  # the kernel as the replay names it: 'aten._scaled_dot_product_flash_attention_for_cpu.default'
    name: str  # the reference composition, in a few words ("the math SDPA")
    reference: str  # the reference composition, in words
    compose: Callable[[dict], tuple | None]  # the kernel's arguments by name -> its leading outputs (None: cannot)
    fix: str  # the code that forces the reference in the user's step
    fix_words: str
    example: Callable[[], dict]  # a small valid call (arguments by name), for the generated test
    user_context: Callable[[], Any] | None = None  # forces the reference in user code (sdpa_kernel(MATH))
    float64_kernel: bool = True  # False: the kernel has no float64 kernel (the probe needs the reference)

    @property
    def overload(self) -> Any:
        return _overload(self.op)

    def why_not(self) -> str | None:
        """Why this row cannot run on this torch (None: it can)."""
        try:
            self.overload  # noqa: B018
        except AttributeError:
            return f"this torch has no {self.op}"
        return None


def _overload(op: str) -> Any:
    pkt, _, name = op.removeprefix("aten.").rpartition(".")
    return getattr(getattr(aten, pkt), name)


def bind(op: Any, args: tuple, kwargs: dict) -> dict:
    """An op call's arguments by their schema names, defaults filled in."""
    schema = ti.op_schema(op)
    if schema is None:
        raise RuntimeError(f"no schema for {op}")
    out, pos = {}, list(args)
    for a in schema.arguments:
        if not a.kwarg_only and pos:
            out[a.name] = pos.pop(0)
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


# ------------------------------------------------------------------ attention


def _math_sdpa(a: dict, mask: str | None) -> tuple | None:
    if a.get("dropout_p"):  # a dropout drawn inside the kernel: its mask is not recorded
        return None
    q, k = a["query"], a["key"]
    gqa = q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1]
    out, _ = aten._scaled_dot_product_attention_math(q, k, a["value"], a.get(mask) if mask else None, 0.0,
                                                     bool(a.get("is_causal")), scale=a.get("scale"), enable_gqa=gqa)
    return (out,)


def _math_sdpa_context():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


_SDPA_FIX = ("from torch.nn.attention import sdpa_kernel, SDPBackend\n"
             "with sdpa_kernel(SDPBackend.MATH):  # around the model's forward (and its backward)\n"
             "    loss = loss_fn(model(x), y)")


def _qkv(L: int = 5, S: int = 5, mask: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    d = {n: torch.randn(2, 2, n_, 8, generator=g) for n, n_ in (("query", L), ("key", S), ("value", S))}
    if mask:
        m = torch.zeros(L, S)
        m[:, -1] = float("-inf")
        d["attn_mask"] = m
    return d


def _attention_row(op: str, mask: str | None, example: Callable[[], dict]) -> Row:
    return Row(op, "the math SDPA", "aten._scaled_dot_product_attention_math: softmax(q·kᵀ·scale + mask)·v with q "
               "and k each scaled by √scale first, what sdpa_kernel(SDPBackend.MATH) runs",
               lambda a: _math_sdpa(a, mask), _SDPA_FIX,
               "force the math attention backend (torch.nn.attention.sdpa_kernel(SDPBackend.MATH))", example,
               _math_sdpa_context)


def _bias(d: dict) -> dict:
    return {**{k: v for k, v in d.items() if k != "attn_mask"}, "attn_bias": d.get("attn_mask"),
            "compute_log_sumexp": True}


# ------------------------------------------------------------------ norms: torch's own decompositions


def _decomposed(op: str, names: tuple[str, ...]) -> Callable[[dict], tuple | None]:
    def compose(a: dict) -> tuple | None:
        fn = ti.decomposition(_overload(op))
        if fn is None:
            return None
        return tuple(fn(*[a[n] for n in names]))
    return compose


def _norm_row(op: str, names: tuple[str, ...], module: str, example: Callable[[], dict]) -> Row:
    return Row(op, f"the decomposed {module}", f"torch's decomposition of {op} into mean, variance and "
               "elementwise ops (torch._decomp)",
               _decomposed(op, names),
               f"# compute the {module} from its definition instead of the fused kernel, e.g. for LayerNorm:\n"
               "#   mean = x.mean(-1, keepdim=True)\n"
               "#   var = x.var(-1, keepdim=True, unbiased=False)\n"
               "#   y = (x - mean) * torch.rsqrt(var + eps) * weight + bias",
               f"compute the {module} from its definition (the decomposed norm) instead of the fused kernel",
               example)


def _ln_example() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input": torch.randn(3, 4, 6, generator=g), "normalized_shape": [6],
            "weight": torch.randn(6, generator=g), "bias": torch.randn(6, generator=g), "eps": 1e-5}


def _gn_example() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input": torch.randn(2, 4, 5, generator=g), "weight": torch.randn(4, generator=g),
            "bias": torch.randn(4, generator=g), "N": 2, "C": 4, "HxW": 5, "group": 2, "eps": 1e-5}


def _bn_example() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input": torch.randn(4, 3, 5, generator=g), "weight": torch.randn(3, generator=g),
         "bias": torch.randn(3, generator=g), "running_mean": torch.zeros(3), "running_var": torch.ones(3),
         "training": True, "momentum": 0.1, "eps": 1e-5}


# ------------------------------------------------------------------ addmm's epilogue


def _addmm(a: dict) -> tuple:
    prod = aten.mm.default(a["mat1"], a["mat2"])
    beta, alpha = a.get("beta", 1), a.get("alpha", 1)
    return (aten.add.Tensor(aten.mul.Tensor(a["self"], beta) if beta != 1 else a["self"],
                            aten.mul.Tensor(prod, alpha) if alpha != 1 else prod),)


def _addmm_example() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"self": torch.randn(6, generator=g), "mat1": torch.randn(4, 5, generator=g),
            "mat2": torch.randn(5, 6, generator=g), "beta": 1, "alpha": 1}


# ------------------------------------------------------------------ oneDNN's RNN layer: the LSTM cell written out


def _lstm(a: dict) -> tuple | None:
    """mkldnn_rnn_layer as the native LSTM computes it: time-major input (T, B, I), weights w_ih, w_hh, b_ih, b_hh,
    gates i, f, g, o; `reverse` runs the sequence backwards (the output stays in time order)."""
    if a["mode"] != 2 or a.get("batch_sizes"):  # 2: LSTM; packed sequences are not written out here
        return None
    x, w_ih, w_hh = a["input"], a["weight0"], a["weight1"]
    bias = (a["weight2"] + a["weight3"]) if a.get("has_biases") else None
    h, c = a["hx_"], a["cx_"]
    steps = range(x.shape[0] - 1, -1, -1) if a.get("reverse") else range(x.shape[0])
    outs: list = [None] * x.shape[0]
    xw = torch.matmul(x, w_ih.t())
    for t in steps:
        gates = xw[t] + torch.matmul(h, w_hh.t())
        if bias is not None:
            gates = gates + bias
        i, f, g, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs[t] = h
    return torch.stack(outs), h, c


def _lstm_example(reverse: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    T, B, n_in, H = 4, 2, 3, 5
    return {"input": torch.randn(T, B, n_in, generator=g), "weight0": torch.randn(4 * H, n_in, generator=g) * 0.5,
            "weight1": torch.randn(4 * H, H, generator=g) * 0.5, "weight2": torch.randn(4 * H, generator=g),
            "weight3": torch.randn(4 * H, generator=g), "hx_": torch.randn(B, H, generator=g),
            "cx_": torch.randn(B, H, generator=g), "reverse": reverse, "batch_sizes": [], "mode": 2,
            "hidden_size": H, "num_layers": 1, "has_biases": True, "bidirectional": False, "batch_first": False,
            "train": True}


def _native_rnn_context():
    return torch.backends.mkldnn.flags(enabled=False)


# ------------------------------------------------------------------ the table

TABLE: dict[str, Row] = {r.op: r for r in (
    _attention_row("aten._scaled_dot_product_flash_attention_for_cpu.default", "attn_mask", lambda: _qkv(mask=True)),
    _attention_row("aten._scaled_dot_product_flash_attention.default", None, _qkv),
    _attention_row("aten._scaled_dot_product_efficient_attention.default", "attn_bias",
                   lambda: _bias(_qkv(mask=True))),
    _attention_row("aten._scaled_dot_product_cudnn_attention.default", "attn_bias", lambda: _bias(_qkv(mask=True))),
    _norm_row("aten.native_layer_norm.default", ("input", "normalized_shape", "weight", "bias", "eps"),
              "layer norm", _ln_example),
    _norm_row("aten.native_group_norm.default", ("input", "weight", "bias", "N", "C", "HxW", "group", "eps"),
              "group norm", _gn_example),
    _norm_row("aten.native_batch_norm.default", ("input", "weight", "bias", "running_mean", "running_var",
                                                 "training", "momentum", "eps"), "batch norm", _bn_example),
    Row("aten.addmm.default", "mm, then add", "the matrix product and the addition as two ops (aten.mm, then aten.add): no fused "
        "epilogue", _addmm, "y = x @ weight.T\ny = y + bias  # instead of F.linear / torch.addmm",
        "compute the product and the bias addition as separate ops", _addmm_example),
    Row("aten.mkldnn_rnn_layer.default", "the native LSTM ops", "the native LSTM ops (the LSTM cell written out: "
        "x·W_ihᵀ + h·W_hhᵀ + b, sigmoid/tanh gates), what torch runs with oneDNN off", _lstm,
        "with torch.backends.mkldnn.flags(enabled=False):  # the native LSTM kernels, not oneDNN's\n"
        "    loss = loss_fn(model(x), y)",
        "run the LSTM on the native kernels (torch.backends.mkldnn.flags(enabled=False))", _lstm_example,
        _native_rnn_context, float64_kernel=False),
)}

NO_FLOAT64 = tuple(r for r in TABLE.values() if not r.float64_kernel)


def row_for(op: str) -> Row | None:
    return TABLE.get(op)


def replace(row: Row, func: Any, args: tuple, kwargs: dict, shapes: list | None = None) -> Any:
    """The kernel's outputs, computed by the reference: the outputs it computes, zeros of the kernel's own shapes
    for the others (`shapes` where the caller knows them — a step program declares them; else the meta kernel's,
    which can differ for a workspace). The kernel itself where the reference cannot (None from compose)."""
    a = bind(func, args, kwargs)
    got = row.compose(a)
    if got is None:
        return func(*args, **kwargs)
    with torch.no_grad():
        meta = func(*_to_meta(args), **_to_meta(kwargs))
    metas = list(meta) if isinstance(meta, (tuple, list)) else [meta]
    if shapes is not None and len(shapes) == len(metas):
        metas = [torch.empty(sh, dtype=m.dtype, device="meta") if isinstance(m, torch.Tensor) else m
                 for sh, m in zip(shapes, metas, strict=True)]
    outs = [g if i < len(got) else _zeros(m, args) for i, (g, m) in enumerate(zip(
        list(got) + [None] * (len(metas) - len(got)), metas, strict=True))]
    return tuple(outs) if isinstance(meta, (tuple, list)) else outs[0]


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


def _zeros(m: Any, args: tuple) -> Any:
    if not isinstance(m, torch.Tensor):
        return m
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    return torch.zeros(m.shape, dtype=m.dtype, device=device)


_REPLACING = [0]  # > 0 while a reference computes a kernel's outputs in its place


def replacing() -> bool:
    """True while a reference stands in for a kernel: its ops are not the step's (a probe counting the step's ops
    by name skips them, as a checkpointed replay's recomputation)."""
    return _REPLACING[0] > 0


class Substituted(TorchFunctionMode):
    """Every call of the rows' kernels (a step program calls them by name) computed by their reference instead;
    `hits` counts the calls replaced, per op. Inside the user's own code the kernel is chosen below the calls
    this sees: `forcing()` adds each row's `user_context` for that."""

    def __init__(self, rows: tuple[Row, ...] | list[Row], shapes: Callable[[], list | None] | None = None):
        super().__init__()
        self.rows = {r.op: r for r in rows}
        self.hits: dict[str, int] = {}
        self.shapes = shapes  # the running call's declared output shapes (StepModule.current_output_shapes)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        row = self.rows.get(str(func)) if isinstance(func, ti.OpOverload) else None
        if row is None:
            return func(*args, **kwargs)
        self.hits[row.op] = self.hits.get(row.op, 0) + 1
        _REPLACING[0] += 1
        try:
            return replace(row, func, args, kwargs, self.shapes() if self.shapes is not None else None)
        finally:
            _REPLACING[0] -= 1


@contextlib.contextmanager
def forcing(rows: tuple[Row, ...] | list[Row], mode: Substituted | None = None):
    """The reference in place of the rows' kernels, wherever the step calls them: yields the `Substituted` mode
    (`mode`, to read its hits afterwards, or a new one)."""
    with contextlib.ExitStack() as stack:
        for r in rows:
            if r.user_context is not None:
                stack.enter_context(r.user_context())
        mode = mode if mode is not None else Substituted(rows)
        stack.enter_context(mode)
        yield mode
