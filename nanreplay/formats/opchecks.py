"""Argument checks per allowlisted op, run before its kernel: the kernels of some ops trust their arguments.

`decode()` proves every argument has the type the op's schema declares; it cannot know that an index
addresses a heap array, that a hidden size sizes a buffer, or that an integer division traps. Reading
the kernels of the allowlisted families found those that do not check (or check too late):

* `embedding_dense_backward` with `scale_grad_by_freq` counts indices into an array of `num_weights`
  without bounds (an out-of-bounds *write*); `_embedding_bag` reads `indices[offsets[i]]` before it checks
  the offset (a negative one quotes heap memory in its error);
* `mkldnn_rnn_layer` sizes its buffers from `hidden_size` and the weights' shapes without comparing them;
* an integer `div(..., rounding_mode='trunc')` of INT_MIN by -1 traps (SIGFPE), as do zero divisors of the
  scalar overloads; the CPU flash-attention kernel divides by a zero-length query or key dimension;
* int-coded enums (`reduction`, `mode`, `interpolation_mode`, ...) index tables inside the kernel;
* derivative kernels and solver helpers trust their companions' shapes (formats/gradchecks.py; the kernels
  `create_graph=True` runs as forward ops and a few later additions: formats/derivchecks.py).

`RULES` maps an op packet to its checks. A check receives a `Call`: the node's arguments by schema name
(tensors as real tensors during a replay, as meta tensors during the dry run), and `value(t)`, the real
tensor behind an argument where its values are known (always in a replay; in the dry run, for tensors
stored in the snapshot). A check returns nothing or raises `Refused("why")`. The same table runs in the
dry run (literals and the stored index tensors, before anything is allocated) and before each kernel of
every replay (index tensors the step computed). Index tensors are small; their min/max costs little.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from nanreplay import torch_internals as ti
from nanreplay.formats.gradchecks import GRAD_CHECKS
from nanreplay.formats.layoutchecks import LAYOUT_CHECKS
from nanreplay.formats.scalechecks import SCALE_CHECKS

INT_MIN = {torch.int64: -(2**63), torch.int32: -(2**31), torch.int16: -(2**15), torch.int8: -(2**7)}
MAX_LIST_OUTPUTS = 100_000  # tensors one op may return as a list (unbind, split)


class Refused(Exception):
    """An argument the op's kernel would trust, and that does not fit (the message says which)."""


class Call:
    """One node's call, its arguments by schema name (defaults filled in)."""

    def __init__(self, op, args: list, kwargs: dict, known: Callable[[Any], torch.Tensor | None]):
        schema = ti.op_schema(op)
        self.name = str(op)
        self.a: dict[str, Any] = {}
        for i, p in enumerate(schema.arguments if schema is not None else ()):
            if i < len(args) and not p.kwarg_only:
                self.a[p.name] = args[i]
            elif p.name in kwargs:
                self.a[p.name] = kwargs[p.name]
            elif p.has_default_value():
                self.a[p.name] = p.default_value
            else:
                self.a[p.name] = None
        self._known = known

    def __getitem__(self, name: str) -> Any:
        return self.a.get(name)

    def value(self, t: Any) -> torch.Tensor | None:
        """The tensor's values, where they are known (None for a meta tensor of the dry run)."""
        if not isinstance(t, torch.Tensor):
            return None
        return self._known(t)


Check = Callable[[Call], None]
RULES: dict[str, list[Check]] = {}


def rule(*packets: str) -> Callable[[Check], Check]:
    """Register a check for these op packets (a packet not on the allowlist is a mistake here)."""
    def deco(fn: Check) -> Check:
        for p in packets:
            RULES.setdefault(p, []).append(fn)
        return fn
    return deco


def check(op, packet: str, args: list, kwargs: dict, known: Callable[[Any], torch.Tensor | None]) -> None:
    """Run the packet's checks (Refused on the first that fails); a packet without checks costs a dict lookup."""
    checks = RULES.get(packet)
    if checks:
        call = Call(op, args, kwargs, known)
        for fn in checks:
            fn(call)


def real_values(t: Any) -> torch.Tensor | None:
    """`known` for a replay: every tensor's values are there."""
    return t if isinstance(t, torch.Tensor) and t.device.type != "meta" else None


# ------------------------------------------------------------------ helpers


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


def _dim(call: Call, arg: str, t: Any) -> int:
    """The dimension `arg` names in `t`, wrapped (Refused when out of range)."""
    d = call[arg]
    n = max(len(_shape(t)), 1)
    if not isinstance(d, int) or not -n <= d < n:
        raise Refused(f"{arg} is outside the {len(_shape(t))} dimensions of its tensor")
    return d % n


def _in_range(call: Call, t: Any, lo: int, hi: int, what: str) -> None:
    """Every value of integer tensor `t` in [lo, hi) (where its values are known)."""
    v = call.value(t)
    if v is None or v.numel() == 0 or v.is_floating_point() or v.is_complex():
        return
    if v.dtype == torch.bool:
        return
    mn, mx = int(v.min()), int(v.max())
    if mn < lo or mx >= hi:
        raise Refused(f"{what} holds values outside [{lo}, {hi})")


def _size(t: Any, d: int) -> int:
    s = _shape(t)
    return s[d] if s else 1


def _ints(v: Any) -> list:
    return v if isinstance(v, list) else [v]


# ------------------------------------------------------------------ int-coded enums


_ENUMS: dict[tuple[str, str], frozenset] = {
    ("_embedding_bag", "mode"): frozenset({0, 1, 2}), ("embedding_bag", "mode"): frozenset({0, 1, 2}),
    ("grid_sampler_2d", "interpolation_mode"): frozenset({0, 1, 2}),
    ("grid_sampler_2d", "padding_mode"): frozenset({0, 1, 2}),
    ("_cdist_forward", "compute_mode"): frozenset({None, 0, 1, 2}), ("cdist", "compute_mode"): frozenset({None, 0, 1, 2}),
    ("mkldnn_rnn_layer", "mode"): frozenset({0, 1, 2, 3}),
}
REDUCTION_PACKETS = ("binary_cross_entropy", "binary_cross_entropy_with_logits", "huber_loss", "kl_div", "mse_loss",
                     "multi_margin_loss", "multilabel_margin_loss_forward", "nll_loss", "nll_loss2d_forward",
                     "nll_loss_forward", "nll_loss_nd", "smooth_l1_loss", "soft_margin_loss")
for _p in REDUCTION_PACKETS:
    _ENUMS[(_p, "reduction")] = frozenset({0, 1, 2})


def _enum_check(packet: str, arg: str, allowed: frozenset) -> Check:
    def fn(call: Call) -> None:
        if arg in call.a and call[arg] not in allowed:
            raise Refused(f"{arg} is not one of the codes the op knows ({', '.join(map(str, sorted(allowed, key=str)))})")
    return fn


for (_p, _arg), _allowed in _ENUMS.items():
    rule(_p)(_enum_check(_p, _arg, _allowed))


# ------------------------------------------------------------------ embeddings


@rule("embedding")
def _embedding(call: Call) -> None:
    w, idx = call["weight"], call["indices"]
    n = _size(w, 0)
    pad = call["padding_idx"]
    if isinstance(pad, int) and pad != -1 and not -n <= pad < n:
        raise Refused(f"padding_idx is outside the {n} rows of the weight")
    _in_range(call, idx, 0, n, "indices")


@rule("embedding_dense_backward")
def _embedding_dense_backward(call: Call) -> None:
    g, idx, n = call["grad_output"], call["indices"], call["num_weights"]
    if not isinstance(n, int) or not 0 <= n < 2**31:
        raise Refused("num_weights is not a row count")
    pad = call["padding_idx"]
    if not isinstance(pad, int) or not -1 <= pad < max(n, 1):
        raise Refused(f"padding_idx is outside the {n} rows")
    gs, ishape = _shape(g), _shape(idx)
    if not gs or math.prod(gs[:-1]) != math.prod(ishape):
        raise Refused("grad_output does not hold one row per index")
    _in_range(call, idx, 0, n, "indices")


@rule("_embedding_bag", "embedding_bag")
def _embedding_bag(call: Call) -> None:
    w, idx, off = call["weight"], call["indices"], call["offsets"]
    n = _size(w, 0)
    if len(_shape(w)) != 2:
        raise Refused("the weight must be a matrix")
    ishape, oshape = _shape(idx), _shape(off)
    if len(ishape) != 1 or len(oshape) != 1:
        raise Refused("indices and offsets must be vectors")
    pad = call["padding_idx"]
    if isinstance(pad, int) and pad != -1 and not -n <= pad < n:
        raise Refused(f"padding_idx is outside the {n} rows of the weight")
    psw = call["per_sample_weights"]
    if isinstance(psw, torch.Tensor) and _shape(psw) != ishape:
        raise Refused("per_sample_weights must hold one weight per index")
    _in_range(call, idx, 0, n, "indices")
    _in_range(call, off, 0, ishape[0] + 1, "offsets")
    v = call.value(off)
    if v is not None and v.numel() > 1 and not bool((v[1:] >= v[:-1]).all()):
        raise Refused("offsets must not decrease")
    if v is not None and v.numel() and int(v[0]) != 0:
        raise Refused("offsets must start at 0")
    # include_last_offset with no bag for the indices: max mode writes into a 0-row output (SIGSEGV)
    if call["include_last_offset"] is True and oshape[0] < 2 and ishape[0] > 0:
        raise Refused("with include_last_offset, offsets must open at least one bag for the indices")


# ------------------------------------------------------------------ gather / scatter / index


@rule("gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_")
def _gather_scatter(call: Call) -> None:
    """Every index addresses a slice of `self` along `dim`; the index fits inside `self` (but along `dim`) and
    inside `src`, where the kernels walk it (torch_geometric's scatter softmax and aggregations run these)."""
    x, idx = call["self"], call["index"]
    d = _dim(call, "dim", x)
    n = _size(x, d)
    xs, ishape = _shape(x), _shape(idx)
    if isinstance(idx, torch.Tensor) and idx.dim() > 0:
        if len(ishape) != max(len(xs), 1):
            raise Refused("index must have as many dimensions as self")
        if any(ishape[k] > _size(x, k) for k in range(len(ishape)) if k != d):
            raise Refused("index is larger than self outside dim")
        src = call["src"]
        if isinstance(src, torch.Tensor) and src.dim() > 0:
            if src.dim() != len(ishape) or any(i > s for i, s in zip(ishape, _shape(src), strict=False)):
                raise Refused("index is larger than src")
    _in_range(call, idx, 0, n, "index")


@rule("index_select", "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_", "index_reduce",
      "index_reduce_")
def _index_dim(call: Call) -> None:
    x, idx = call["self"], call["index"]
    d = _dim(call, "dim", x)
    n = _size(x, d)
    _in_range(call, idx, -n, n, "index")
    src = call["source"]
    if isinstance(src, torch.Tensor) and isinstance(idx, torch.Tensor) and src.dim() > 0 and _shape(x):
        if src.dim() != len(_shape(x)) or _size(src, d) != idx.numel():
            raise Refused("source must have one slice per index")


@rule("take")
def _take(call: Call) -> None:
    n = math.prod(_shape(call["self"]))
    _in_range(call, call["index"], -n, n, "index")


@rule("index", "index_put", "index_put_")
def _index(call: Call) -> None:
    x = call["self"]
    shape = _shape(x)
    idxs = call["indices"] or []
    if len(idxs) > len(shape):
        raise Refused("more indices than dimensions")
    d = 0
    for t in idxs:
        if isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8):
            k = max(t.dim(), 1)
            if tuple(t.shape) != shape[d:d + t.dim()]:
                raise Refused("a mask index must match the shape it indexes")
            d += k
            continue
        if isinstance(t, torch.Tensor):
            n = shape[d] if d < len(shape) else 1
            _in_range(call, t, -n, n, "an index")
        d += 1


# ------------------------------------------------------------------ splits and lists of outputs


@rule("split_with_sizes", "unsafe_split_with_sizes", "split", "unsafe_split")
def _split_sizes(call: Call) -> None:
    x = call["self"]
    sizes = call["split_sizes"] if "split_sizes" in call.a else call["split_size"]
    d = _dim(call, "dim", x)
    n = _size(x, d)
    if isinstance(sizes, list):
        if any(not isinstance(s, int) or s < 0 for s in sizes) or sum(sizes) != n:
            raise Refused(f"split sizes must be non-negative and add up to {n}")
        count = len(sizes)
    else:
        if not isinstance(sizes, int) or sizes < 0 or (sizes == 0 and n > 0):
            raise Refused(f"the split size cannot split {n}")
        count = max(1, -(-n // sizes)) if sizes else 1
    if count > MAX_LIST_OUTPUTS:
        raise Refused(f"it would make {count} tensors (at most {MAX_LIST_OUTPUTS})")


@rule("unbind")
def _unbind(call: Call) -> None:
    x = call["self"]
    if not _shape(x):
        raise Refused("cannot unbind a 0-d tensor")
    n = _size(x, _dim(call, "dim", x))
    if n > MAX_LIST_OUTPUTS:
        raise Refused(f"it would make {n} tensors (at most {MAX_LIST_OUTPUTS})")


# ------------------------------------------------------------------ recurrent layers


_GATES = {0: 1, 1: 1, 2: 4, 3: 3}  # RNN_RELU, RNN_TANH, LSTM, GRU


@rule("mkldnn_rnn_layer")
def _mkldnn_rnn_layer(call: Call) -> None:
    x, h = call["input"], call["hidden_size"]
    gates = _GATES.get(call["mode"])
    if gates is None or not isinstance(h, int) or h <= 0:
        raise Refused("mode and hidden_size must describe a recurrent layer")
    xs = _shape(x)
    if len(xs) != 3 or 0 in xs:
        raise Refused("input must be a non-empty (sequence, batch, features) tensor")
    # the batch is one of the first two dimensions: torch's LSTM may pass the input already transposed while
    # batch_first still says how the module was built, so accept either (each bounds the state buffers)
    batches = {xs[0], xs[1]}
    want = {"weight0": (gates * h, xs[2]), "weight1": (gates * h, h)}
    if call["has_biases"]:
        want |= {"weight2": (gates * h,), "weight3": (gates * h,)}
    for name, shape in want.items():
        if _shape(call[name]) != shape:
            raise Refused(f"{name} is {list(_shape(call[name]))}, which does not fit hidden_size")
    for name in ("hx_", "cx_"):
        s = _shape(call[name])
        if s[-1:] != (h,) or not any(math.prod(s) == b * h for b in batches):
            raise Refused(f"{name} is {list(s)}, which does not fit the batch and hidden_size")
    if call["batch_sizes"]:
        raise Refused("packed sequences (batch_sizes) are not replayed")


# ------------------------------------------------------------------ integer division


_INT_DIVISION = ("div", "div_", "floor_divide", "remainder", "fmod")


@rule(*_INT_DIVISION)
def _integer_division(call: Call) -> None:
    """An integer quotient or remainder: no zero divisor, and no INT_MIN / -1 (it traps)."""
    if call.name.startswith(("aten.div.", "aten.div_.")) and call["rounding_mode"] is None:
        return  # true division: the result is floating point
    a, b = call["self"], call["other"]
    dt = _result_dtype(a, b)
    if dt is None or dt.is_floating_point or dt.is_complex or dt == torch.bool:
        return
    av = call.value(a) if isinstance(a, torch.Tensor) else a
    bv = call.value(b) if isinstance(b, torch.Tensor) else b
    if bv is not None and _any(bv, 0):
        raise Refused("an integer division by zero")
    lo = INT_MIN.get(dt)
    if lo is None or av is None or bv is None or not _any(bv, -1):
        return
    if isinstance(av, torch.Tensor) and isinstance(bv, torch.Tensor):
        try:
            bad = bool(((av == lo) & (bv == -1)).any())
        except RuntimeError:
            return  # shapes that do not broadcast: the kernel says so itself
    else:
        bad = _any(av, lo)
    if bad:
        raise Refused("an integer division of the smallest integer by -1")


def _any(v: Any, x: int) -> bool:
    if isinstance(v, torch.Tensor):
        return bool((v == x).any())
    return v == x


def _result_dtype(a: Any, b: Any) -> torch.dtype | None:
    """The dtype the op computes in; two plain numbers (which a Tensor argument may be) wrap as 0-d tensors."""
    try:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return torch.result_type(a, b)
        return torch.result_type(torch.tensor(a), torch.tensor(b))
    except (RuntimeError, TypeError, OverflowError):
        return None


# ------------------------------------------------------------------ fused attention


@rule("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
def _fused_attention(call: Call) -> None:
    q, k, v = call["query"], call["key"], call["value"]
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    if not (len(qs) == len(ks) == len(vs) == 4):
        raise Refused("query, key and value must be 4-d (batch, heads, length, features)")
    if 0 in qs or 0 in ks or 0 in vs:
        raise Refused("a fused attention kernel given a zero-length dimension")
    if qs[0] != ks[0] or ks[:3] != vs[:3] or qs[3] != ks[3] or qs[1] % ks[1]:
        raise Refused("query, key and value shapes do not fit together")
    mask = call["attn_mask"] if "attn_mask" in call.a else call["attn_bias"]
    if isinstance(mask, torch.Tensor):
        full = (qs[0], qs[1], qs[2], ks[2])
        ms = _shape(mask)
        if len(ms) > 4 or any(m not in (1, f) for m, f in zip(reversed(ms), reversed(full), strict=False)):
            raise Refused("the attention mask does not broadcast to (batch, heads, queries, keys)")


# ------------------------------------------------------------------ normalisation with sizes as literals


@rule("native_group_norm")
def _group_norm(call: Call) -> None:
    x, n, c, hw, g = call["input"], call["N"], call["C"], call["HxW"], call["group"]
    xs = _shape(x)
    if not all(isinstance(v, int) and v >= 0 for v in (n, c, hw)) or not isinstance(g, int) or g <= 0:
        raise Refused("N, C, HxW and group must be sizes")
    if len(xs) < 2 or xs[0] != n or xs[1] != c or math.prod(xs) != n * c * hw or c % g:
        raise Refused(f"N, C, HxW and group do not describe the input {list(xs)}")
    for name in ("weight", "bias"):
        t = call[name]
        if isinstance(t, torch.Tensor) and _shape(t) != (c,):
            raise Refused(f"{name} must hold {c} values")


# ------------------------------------------------------------------ round 3 (issue 37): stats, scales, groups


@rule("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
      "_native_batch_norm_legit_functional", "native_batch_norm_backward")
def _batch_norm(call: Call) -> None:
    """The kernel writes running statistics and reads weight/bias by channel without comparing their length
    with the input's channels (a heap write past 1-element statistics)."""
    xs = _shape(call["input"])
    if len(xs) < 2:
        raise Refused("the input must have a channel dimension")
    for name in ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd"):
        t = call[name]
        if name.startswith("save_") and isinstance(t, torch.Tensor) and t.numel() == 0 and call["train"] is False:
            continue  # eval mode saves nothing (in train mode the kernel reads them: SIGSEGV on empty ones)
        if isinstance(t, torch.Tensor) and _shape(t) != (xs[1],):
            raise Refused(f"{name} is {list(_shape(t))}, not one value per channel of the input ({xs[1]})")
    g = call["grad_out"]
    if isinstance(g, torch.Tensor) and _shape(g) != xs:
        raise Refused("grad_out does not have the input's shape")


@rule("upsample_bicubic2d", "upsample_bilinear2d", "upsample_linear1d", "upsample_nearest1d", "upsample_nearest2d",
      "upsample_nearest3d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")
def _upsample(call: Call) -> None:
    """A NaN, infinite, zero or negative scale reaches the kernel's index arithmetic (a NaN scale segfaults)."""
    for name in ("scales", "scales_d", "scales_h", "scales_w", "scale_factors"):
        for s in _ints(call[name]) if call[name] is not None else ():
            if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s) or s <= 0:
                raise Refused(f"{name} must be finite and positive")
    size = call["output_size"]
    if size is not None and any(not isinstance(n, int) or n <= 0 for n in _ints(size)):
        raise Refused("output_size must be positive sizes")


@rule("_grouped_mm")
def _grouped_mm(call: Call) -> None:
    """Rows (or columns) past the last offset are left uninitialised by the kernel: the offsets must rise and cover
    the grouped dimension, so every element of the result is computed."""
    a, b, offs = call["self"], call["mat2"], call["offs"]
    if not isinstance(offs, torch.Tensor):
        return
    sa, sb = _shape(a), _shape(b)
    grouped = {(2, 3): sa[:1], (3, 2): sb[1:2], (2, 2): sa[1:2]}.get((len(sa), len(sb)))
    if grouped is None or len(_shape(offs)) != 1:
        raise Refused("offsets need a 2-d operand and must be a vector")
    n = grouped[0]
    v = call.value(offs)
    if v is None or v.numel() == 0:
        return
    v = v.to(torch.int64)
    if int(v.min()) < 0 or bool((v[1:] < v[:-1]).any()) or int(v.max()) > n:
        raise Refused(f"offsets must rise within [0, {n}]")
    if len(sb) == 3 and int(v[-1]) != n or len(sa) == 3 and int(v[-1]) != n:
        raise Refused(f"the offsets end at {int(v[-1])}, short of the {n} rows or columns they group: the rest of "
                      "the result would be uninitialised memory")


# ------------------------------------------------------------------ the FFT family (torch.stft, torch.fft.*)


_FFT_NORMS = frozenset({0, 1, 2})  # none, by 1/sqrt(n), by 1/n (fft_norm_mode)


@rule("_fft_r2c", "_fft_c2r", "_fft_c2c")
def _fft(call: Call) -> None:
    """The transformed dims exist, are distinct and non-empty; the norm is a code the kernel knows; the input is
    real for r2c and complex otherwise; a c2r reads last_dim_size // 2 + 1 bins of its last dim (torch.fft always
    trims or pads the input to that), so the input holds exactly that many."""
    x, dims = call["self"], call["dim"]
    xs = _shape(x)
    if not isinstance(x, torch.Tensor):
        return  # the schema check has already refused it
    if not isinstance(dims, list) or not dims or len(dims) > len(xs):
        raise Refused(f"dim must name 1 to {len(xs)} dimensions of the input")
    if any(not isinstance(d, int) or not -len(xs) <= d < len(xs) for d in dims):
        raise Refused(f"dim is outside the {len(xs)} dimensions of the input")
    wrapped = [d % len(xs) for d in dims]
    if len(set(wrapped)) != len(wrapped):
        raise Refused("dim names a dimension twice")
    if any(xs[d] == 0 for d in wrapped):
        raise Refused("a transformed dimension is empty")
    if call["normalization"] not in _FFT_NORMS:
        raise Refused("normalization is not one of the codes the op knows (0, 1, 2)")
    real = call.name.startswith("aten._fft_r2c")
    if real != (not x.is_complex()) or (real and not x.is_floating_point()):
        raise Refused("the input must be real floating point" if real else "the input must be complex")
    if call.name.startswith("aten._fft_c2r"):
        last = call["last_dim_size"]
        if not isinstance(last, int) or last < 1 or xs[wrapped[-1]] != last // 2 + 1:
            raise Refused("last_dim_size does not fit the input's last transformed dimension")


@rule("unfold_backward")
def _unfold_backward(call: Call) -> None:
    """torch.istft's overlap-add: the kernel walks grad_in with strides computed from input_sizes, size and step,
    so grad_in must be exactly what `unfold(dim, size, step)` of a tensor of input_sizes makes."""
    g, sizes, size, step = call["grad_in"], call["input_sizes"], call["size"], call["step"]
    gs = _shape(g)
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise Refused("input_sizes must be sizes")
    n = max(len(sizes), 1)
    d = call["dim"]
    if not isinstance(d, int) or not -n <= d < n:
        raise Refused(f"dim is outside the {len(sizes)} dimensions of input_sizes")
    d %= n
    if not (isinstance(size, int) and isinstance(step, int) and size > 0 and step > 0):
        raise Refused("size and step must be positive")
    full = list(sizes) if sizes else [1]
    if full[d] < size:
        raise Refused("size is larger than the unfolded dimension")
    want = full[:d] + [(full[d] - size) // step + 1] + full[d + 1:] + [size]
    if list(gs) != want:
        raise Refused(f"grad_in is {list(gs)}, not what unfolding input_sizes makes")


# ------------------------------------------------------------------ torch.distributions' argument validation


@rule("_is_all_true")
def _is_all_true(call: Call) -> None:
    """`torch._is_all_true(valid)`: a reduction of the bool tensor a constraint check made (the `raise` after it
    is Python, not an op, and is not in a program); its kernel asserts the dtype."""
    x = call["self"]
    if isinstance(x, torch.Tensor) and x.dtype != torch.bool:
        raise Refused("the input must be a bool tensor")


def _refusing(why: Callable[[Call], str | None]) -> Check:
    def fn(call: Call) -> None:
        if (reason := why(call)) is not None:
            raise Refused(reason)
    return fn


# derivative kernels and solver helpers (formats/gradchecks.py); kernels that ignore strides (formats/layoutchecks.py)
for _p, _why in [*GRAD_CHECKS.items(), *LAYOUT_CHECKS.items(), *SCALE_CHECKS.items()]:  # (scalechecks.py)
    rule(_p)(_refusing(_why))
