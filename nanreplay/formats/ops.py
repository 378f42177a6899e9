"""The allowlist of aten ops a step program may hold, and the strings some of their arguments may take.

The list names op *packets* (`aten.add`); every overload of an allowed packet is allowed
unless a denial rule below matches it. The packets were collected from what real models
emit when their training step is recorded (GPT/nanoGPT, CNNs with BatchNorm, RNNs,
transformer layers, VAEs, 20 losses — `benchmarks/collect_ops.py` prints the current set)
and completed with the pure tensor ops of the same families. Nothing here touches files,
storages, streams, generators or other processes; `tests/formats` checks every allowed
overload against the denial rules.
"""

from __future__ import annotations

import functools
import re

import torch

# Never allowed, whatever the packet list says.
DENIED = re.compile(r"from_file|\.prim_|_copy_from|^aten\.set_|\.set_|as_strided|resize|record_stream|pin_memory|"
                    r"share_memory|_assert|_print|\.lift|_local_scalar_dense|\.out$|_out$|\.out_|"
                    r"^aten\.(_?nested|_sparse|sparse|to_sparse|_cudnn|_mps|_nnpack|_fused_|_foreach)")
# Argument types an allowed overload may never take (a generator may appear only as an optional
# argument, which a program always leaves null).
DENIED_ARG_TYPES = ("Storage", "Stream", "Dimname", "Any")

PACKETS = frozenset("""
abs absolute acos acosh adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d _adaptive_avg_pool2d
_adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d add add_ addbmm addcdiv addcdiv_
addcmul addcmul_ addmm addmm_ addmv addr alias all amax amin aminmax angle any arange argmax argmin argsort asin
asinh atan atan2 atanh avg_pool1d avg_pool2d avg_pool3d baddbmm bernoulli bernoulli_ binary_cross_entropy
binary_cross_entropy_with_logits bitwise_and bitwise_not bitwise_or bitwise_xor bmm broadcast_to bucketize cat
cdist _cdist_forward ceil celu clamp clamp_ clamp_max clamp_max_ clamp_min clamp_min_ clip clone col2im
constant_pad_nd contiguous convolution _convolution conv1d conv2d conv3d conv_transpose1d conv_transpose2d
conv_transpose3d copy copy_ cos cosh cosine_similarity count_nonzero cross cumprod cummax cummin cumsum deg2rad
detach diag diag_embed diagonal diff digamma div div_ dot dropout elu elu_ embedding _embedding_bag embedding_bag
empty empty_like eq eq_ erf erfc erfinv exp exp2 exp_ expand expand_as expm1 exponential_ eye fill fill_ fix
flatten flip fliplr flipud floor floor_divide fmax fmin fmod frac full full_like gather gcd ge gelu gelu_ glu
grid_sampler_2d gt hardshrink hardsigmoid hardsigmoid_ hardswish hardswish_ hardtanh hardtanh_ heaviside
huber_loss hypot i0 im2col index index_add index_add_ index_copy index_fill index_fill_ index_put index_put_
index_reduce index_select isfinite isinf isnan isneginf isposinf kl_div kthvalue lcm le leaky_relu leaky_relu_
lerp lerp_ lgamma linalg_vector_norm linalg_norm linear linspace log log10 log1p log2 log_ log_sigmoid_forward
log_softmax _log_softmax logaddexp logaddexp2 logcumsumexp logical_and logical_not logical_or logical_xor logit
logspace logsumexp lt masked_fill masked_fill_ masked_scatter masked_select matmul max max_pool1d max_pool2d
max_pool2d_with_indices max_pool3d max_pool3d_with_indices maximum mean median min minimum mish mish_ mkldnn_rnn_layer
mm mode mse_loss mul mul_ multi_margin_loss multilabel_margin_loss_forward multinomial mv mvlgamma nan_to_num
nan_to_num_ nanmean nanmedian nansum narrow native_batch_norm _native_batch_norm_legit
_native_batch_norm_legit_functional _native_batch_norm_legit_no_training native_dropout native_group_norm
native_layer_norm ne neg neg_ new_empty new_full new_ones new_zeros nll_loss nll_loss2d_forward nll_loss_forward
nll_loss_nd nonzero norm normal normal_ ones ones_like outer pad permute pixel_shuffle pixel_unshuffle polar pow pow_
prelu _prelu_kernel prod rad2deg rand rand_like randint randint_like randn randn_like randperm reciprocal
reciprocal_ reflection_pad1d reflection_pad2d reflection_pad3d relu relu_ relu6 remainder repeat
repeat_interleave replication_pad1d replication_pad2d replication_pad3d reshape roll rot90 round
rsqrt rsqrt_ rsub scalar_tensor scatter scatter_ scatter_add scatter_add_ scatter_reduce select select_scatter
selu sgn sigmoid sigmoid_ sign signbit silu silu_ sin sinc sinh slice slice_scatter smooth_l1_loss
soft_margin_loss softmax _softmax _safe_softmax softplus softshrink sort special_entr special_erfcx
special_i0e special_i1 special_i1e special_log_ndtr special_ndtri special_xlog1py special_xlogy split
split_with_sizes sqrt sqrt_ square squeeze stack std std_mean sub sub_ sum t tan tanh tanh_ take
_scaled_dot_product_attention_math _scaled_dot_product_flash_attention_for_cpu
_scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention
_scaled_dot_product_cudnn_attention scaled_dot_product_attention threshold threshold_ tile topk trace transpose
transpose_ tril tril_ triu triu_ true_divide trunc type_as unbind unflatten unfold uniform_ unique_consecutive
_unique2 unsafe_split unsafe_split_with_sizes _unsafe_view unsqueeze unsqueeze_ upsample_bicubic2d
upsample_bilinear2d upsample_linear1d upsample_nearest1d upsample_nearest2d upsample_nearest3d
upsample_trilinear3d var var_mean view view_as where xlogy xlogy_ zero_ zeros zeros_like _to_copy to
_log_softmax_backward_data _softmax_backward_data log_sigmoid_backward threshold_backward
native_layer_norm_backward native_batch_norm_backward convolution_backward embedding_dense_backward
_weight_norm_interface _ctc_loss
""".split())

# ---- Added from the capture sweep (benchmarks/capture_sweep.py, issue 26): pure tensor ops that the world's
# models emit (transformers' MoE routers: histc; nn.Bilinear: _trilinear; ShuffleNet-style blocks: channel_shuffle;
# nn.FractionalMaxPool*d, whose random samples are recorded values; parametrizations.orthogonal: matrix_exp;
# transformers' grouped experts: _grouped_mm; gated delta-net layers: linalg_solve_triangular).
SWEEP_PACKETS = frozenset("""
histc _grouped_mm _trilinear linalg_solve_triangular channel_shuffle native_channel_shuffle
fractional_max_pool2d fractional_max_pool3d matrix_exp linalg_matrix_exp
""".split())
PACKETS = PACKETS | SWEEP_PACKETS

# ---- Added for issue 36 (what real models run): scatter-based GNNs (torch_geometric's softmax and aggregations run
# scatter_reduce_ in place), the FFT family (torch.stft / log-Mel front-ends, FNet), complex tensors as data
# (view_as_complex rotary embeddings), and torch.distributions' argument validation, whose `_is_all_true` is a pure
# reduction of a bool tensor (the Python `raise` after it is not an op; `_assert_*` stays denied). torch.istft's
# overlap-add runs unfold_backward in its forward; nn.utils.spectral_norm's power iteration runs vdot. Each comes with
# its checks in formats/opchecks.py: index values and shapes, FFT dims, norms and sizes, a bool input.
OPS_36 = frozenset("""
scatter_reduce_ index_reduce_ _fft_r2c _fft_c2r _fft_c2c view_as_complex view_as_real real imag conj _conj
resolve_conj conj_physical _conj_physical complex _neg_view resolve_neg _is_all_true unfold_backward
logical_not_ logical_and_ logical_or_ logical_xor_ index_copy_ vdot linalg_cross
""".split())  # linalg_cross: torch.cross in a 6-d rotation representation (the real-bug benchmark's geodesic loss)
PACKETS = PACKETS | OPS_36

# ---- Added for issue 38 (double backward): `torch.autograd.grad(..., create_graph=True)` (WGAN-GP's gradient penalty,
# input-gradient regularisers, MAML) runs the activations' and losses' derivative kernels as forward ops of the step,
# so they join the program. They are elementwise TensorIterator kernels that check their own broadcasting;
# formats/opchecks.py also requires the gradient to have the shape of what it differentiates (what autograd passes)
# and a known `reduction` code for the losses. Their `grad_input=` overloads stay out (out= style arguments).
DOUBLE_BACKWARD = frozenset("""
hardtanh_backward sigmoid_backward tanh_backward leaky_relu_backward gelu_backward softplus_backward elu_backward
silu_backward mish_backward hardsigmoid_backward hardswish_backward softshrink_backward hardshrink_backward
logit_backward mse_loss_backward smooth_l1_loss_backward huber_loss_backward soft_margin_loss_backward
binary_cross_entropy_backward
nll_loss_backward nll_loss2d_backward max_pool2d_with_indices_backward avg_pool2d_backward
_adaptive_avg_pool2d_backward slice_backward select_backward diagonal_backward squeeze_
""".split())  # from nll_loss_backward on (open world): MAML's inner loop on a CNN with
# cross-entropy; physics-informed losses that differentiate a slice or column of a gradient (u_xx); torch.func's jacrev
PACKETS = PACKETS | DOUBLE_BACKWARD
# Open-world audit, round 2: packed sequences (`pack_padded_sequence` before an RNN); its lengths are checked in
# formats/opchecks.py (the kernel reads `lengths[0]` time steps of the input without comparing them with its length)
PACKETS = PACKETS | {"_pack_padded_sequence", "affine_grid_generator", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"}
# (with them: a spatial transformer's `F.affine_grid`, and `F.interpolate(..., antialias=True)` resizing in the step)
# Metric learning and robust losses: `F.pdist`, `torch.triu_indices` pairs, `torch.isin` label masks, `torch.quantile`
# (its `ceil_`), `torch.searchsorted` binning (the kernel checks `sorter`'s indices itself), `torch.polygamma`.
PACKETS = PACKETS | frozenset("""
_pdist_forward triu_indices tril_indices isin searchsorted ceil_ floor_ round_ trunc_ polygamma
""".split())

# ---- Added by the open-world audit: the dense linear algebra real models run in their step —
# torch.distributions.MultivariateNormal (cholesky, then a triangular solve), Gaussian processes (cholesky_solve),
# normalizing flows (slogdet, det, inv), whitening and orthogonality penalties (eigh, svd, qr), least squares (solve).
# LAPACK kernels read their matrices' values and nothing else: they check square/batch shapes themselves and raise.
# `_linalg_check_errors` is how `torch.linalg.cholesky` and friends raise on a failed factorisation (its
# api_name is a fixed word). The LU family (`lu_solve`, `lu_unpack`, `linalg_lu*`) stays out: it reads pivot
# *indices* a crafted file could aim anywhere. The dry run counts their cubic work (formats/dryrun.py).
LINALG = frozenset("""
linalg_cholesky_ex cholesky _linalg_solve_ex _linalg_svd _linalg_eigh linalg_eig linalg_inv_ex _linalg_det
_linalg_slogdet linalg_qr cholesky_solve _cholesky_solve_helper cholesky_inverse triangular_solve logdet
_linalg_check_errors geqrf linalg_householder_product
bitwise_and_ bitwise_or_ bitwise_xor_ bitwise_not_
""".split())  # bitwise_*_: MultivariateNormal's argument validation combines its checks with `&=` on bool masks
PACKETS = PACKETS | LINALG

# (op packet, argument) -> allowed values (a frozenset) or a full-match regex.
STRING_ARGS: dict[tuple[str, str], frozenset[str] | re.Pattern] = {
    ("div", "rounding_mode"): frozenset({"trunc", "floor"}),
    ("div_", "rounding_mode"): frozenset({"trunc", "floor"}),
    ("gelu", "approximate"): frozenset({"none", "tanh"}),
    ("gelu_", "approximate"): frozenset({"none", "tanh"}),
    ("gelu_backward", "approximate"): frozenset({"none", "tanh"}),
    ("einsum", "equation"): re.compile(r"[a-zA-Z.,\->\s]{1,128}"),
    ("scatter", "reduce"): frozenset({"add", "multiply"}),
    ("scatter_", "reduce"): frozenset({"add", "multiply"}),
    ("scatter_reduce", "reduce"): frozenset({"sum", "prod", "mean", "amax", "amin"}),
    ("scatter_reduce_", "reduce"): frozenset({"sum", "prod", "mean", "amax", "amin"}),
    ("index_reduce", "reduce"): frozenset({"prod", "mean", "amax", "amin"}),
    ("index_reduce_", "reduce"): frozenset({"prod", "mean", "amax", "amin"}),
    ("searchsorted", "side"): frozenset({"left", "right"}),
    ("pad", "mode"): frozenset({"constant", "reflect", "replicate", "circular"}),
    ("norm", "p"): frozenset({"fro"}),
    ("linalg_norm", "ord"): frozenset({"fro", "nuc"}),
    ("_linalg_eigh", "UPLO"): frozenset({"L", "U"}),
    ("linalg_qr", "mode"): frozenset({"reduced", "complete", "r"}),
    ("_linalg_svd", "driver"): frozenset({"gesvd", "gesvdj", "gesvda"}),
    ("_linalg_check_errors", "api_name"): re.compile(r"[a-z_]{1,32}(\.[a-z_]{1,32})?"),
}




def _weight_norm_args(a: dict) -> str | None:
    """weight_norm's fused kernel reads one g per slice of v along dim, trusting g to hold that many."""
    v, g, dim = a.get("v"), a.get("g"), a.get("dim", 0)
    if not (isinstance(v, torch.Tensor) and isinstance(g, torch.Tensor) and isinstance(dim, int)):
        return None  # the schema check has already said what is wrong with them
    if v.dim() == 0 or dim not in (0, v.dim() - 1, -1):
        return f"dim {dim} is neither the first nor the last of v's {v.dim()} dimensions"
    if g.numel() != v.shape[dim]:
        return f"g holds {g.numel()} values, v has {v.shape[dim]} slices along dim {dim}"
    return None


def _ctc_args(a: dict) -> str | None:
    """CTC's kernels index log_probs' classes by every target label and trust blank and the lengths."""
    lp, tg, il, tl, blank = (a.get(k) for k in ("log_probs", "targets", "input_lengths", "target_lengths", "blank"))
    if not (isinstance(lp, torch.Tensor) and isinstance(tg, torch.Tensor)) or lp.dim() not in (2, 3):
        return None if not isinstance(lp, torch.Tensor) else f"log_probs has {lp.dim()} dimensions (2 or 3)"
    t_max, n, classes = lp.shape[0], (lp.shape[1] if lp.dim() == 3 else 1), lp.shape[-1]
    blank = 0 if blank is None else blank
    if not (isinstance(blank, int) and 0 <= blank < classes):
        return f"blank {blank} is not one of the {classes} classes"
    lengths = {}
    for name, v in (("input_lengths", il), ("target_lengths", tl)):
        if isinstance(v, torch.Tensor):
            if v.device.type == "meta":
                return None  # values unknown on the meta device: checked again before the kernel runs
            v = v.reshape(-1).tolist()
        if not isinstance(v, list) or len(v) != n or not all(isinstance(x, int) for x in v):
            return f"{name} must hold {n} integers"
        lengths[name] = v
    if any(not 0 <= x <= t_max for x in lengths["input_lengths"]):
        return f"an input length is outside 0..{t_max}"
    tls = lengths["target_lengths"]
    two_d = lp.dim() == 3 and tg.dim() == 2  # padded (N, S) targets; else all targets concatenated
    if tg.dim() > 2 or any(x < 0 for x in tls) or (two_d and (tg.shape[0] != n or any(x > tg.shape[1] for x in tls))) \
            or (not two_d and sum(tls) > tg.numel()):
        return "the target lengths address labels the targets do not hold"
    if tg.device.type == "meta" or tg.numel() == 0:
        return None
    if tg.is_floating_point() or tg.is_complex():
        return "targets must be integer labels"
    if two_d:
        used = tg[torch.arange(tg.shape[-1], device=tg.device)[None, :] < torch.tensor(tls, device=tg.device)[:, None]]
    else:
        used = tg.reshape(-1)[:sum(tls)]
    if used.numel() and not (0 <= int(used.min()) and int(used.max()) < classes):
        return f"a target label is not one of the {classes} classes"
    return None


# op packet -> a check of the call's values against the shapes they address, run before the kernel (on the
# meta device in the dry run, on the real tensors in the replay): kernels that trust their arguments to index
# inside their tensors. The function gets the arguments by name and returns why the call is refused, or None.
VALUE_CHECKS = {
    "_weight_norm_interface": _weight_norm_args,
    "_ctc_loss": _ctc_args,
}


def check_values(op, name: str, args: list, kwargs: dict) -> str | None:
    """Why the call `name(*args, **kwargs)` is refused by its packet's VALUE_CHECKS entry (None: no rule / fine)."""
    rule = VALUE_CHECKS.get(name.split(".")[1]) if name.count(".") == 2 else None
    if rule is None:
        return None
    schema = getattr(op, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return rule(bound)


def _overload_ok(name: str, op) -> bool:
    if DENIED.search(name):
        return False
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    returns = [str(r.type) for r in schema.returns]
    tensors = [t for t in returns if "Tensor" in t]
    # an op on plain Python values (`remainder.int`, `gcd.int`, `add.Scalar`) runs for real in the dry run, on
    # ints a file chose: only ops that return tensors (beside them, at most the sizes flash attention returns)
    if not tensors or any(t not in ("int", "SymInt") for t in returns if "Tensor" not in t):
        return False
    for a in list(schema.arguments):
        t = str(a.type)
        if any(bad in t for bad in DENIED_ARG_TYPES):
            return False
        if "Generator" in t and not (t.startswith("Optional[") or t.endswith("?")):
            return False  # a generator the program would have to supply
        if a.alias_info is not None and a.alias_info.is_write and a.kwarg_only:
            return False  # out= style arguments
    return True


@functools.lru_cache(maxsize=1)
def _allowed() -> frozenset[str]:
    out = set()
    for packet in PACKETS:
        p = getattr(torch.ops.aten, packet, None)
        if p is None:
            continue
        try:
            overloads = p.overloads()
        except Exception:  # noqa: BLE001,S112 - a packet this torch lacks
            continue
        for ov in overloads:
            op = getattr(p, ov, None)
            name = f"aten.{packet}.{ov}"
            if op is not None and _overload_ok(name, op):
                out.add(name)
    return frozenset(out)


class _Allowlist:
    """`name in ALLOWED_OPS` for 'aten.packet.overload' names (computed once, on first use)."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in _allowed()

    def __iter__(self):
        return iter(sorted(_allowed()))

    def __len__(self) -> int:
        return len(_allowed())


ALLOWED_OPS = _Allowlist()
