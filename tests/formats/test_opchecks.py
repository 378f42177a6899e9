"""The per-op argument table (formats/opchecks.py), case by case: for every packet it holds a call the op's
kernel accepts, which passes, and one it would trust and must not see, which is refused. A packet added to
the table without cases here fails `test_every_packet_of_the_table_has_cases`."""

from __future__ import annotations

import pytest
import torch

from nanreplay.formats import derivchecks, opchecks  # noqa: F401 - derivchecks adds its checks to the table
from nanreplay.formats.ops import ALLOWED_OPS

BIG = 2**40
I64_MIN = -(2**63)


def t(*v, dtype=torch.int64):
    return torch.tensor(list(v), dtype=dtype)


W = torch.randn(10, 4)
X34 = torch.randn(3, 4)
Q = torch.randn(1, 2, 4, 8)


def _rnn(hidden: int, w0: int = 32) -> dict:
    return dict(input=torch.randn(5, 2, 4), weight0=torch.randn(w0, 4), weight1=torch.randn(32, 8),
                weight2=torch.randn(32), weight3=torch.randn(32), hx_=torch.zeros(2, 8), cx_=torch.zeros(2, 8),
                reverse=False, batch_sizes=[], mode=2, hidden_size=hidden, num_layers=1, has_biases=True,
                bidirectional=False, batch_first=False, train=True)


def _bag(**kw) -> dict:
    return dict(weight=W, indices=t(1, 2, 3), offsets=t(0, 1)) | kw


# packet -> [(overload, accepted kwargs, refused kwargs), ...]
CASES: dict[str, list[tuple[str, dict, dict]]] = {
    "embedding": [("default", dict(weight=W, indices=t(1, 9)), dict(weight=W, indices=t(1, BIG))),
                  ("default", dict(weight=W, indices=t(1), padding_idx=3), dict(weight=W, indices=t(1), padding_idx=BIG))],
    "embedding_dense_backward": [
        ("default", dict(grad_output=torch.ones(3, 4), indices=t(2, 0, 1), num_weights=10, padding_idx=-1,
                         scale_grad_by_freq=True),
         dict(grad_output=torch.ones(3, 4), indices=t(BIG, 0, 1), num_weights=10, padding_idx=-1,
              scale_grad_by_freq=True)),
        ("default", dict(grad_output=torch.ones(3, 4), indices=t(2, 0, 1), num_weights=10, padding_idx=-1,
                         scale_grad_by_freq=True),
         dict(grad_output=torch.ones(3, 4), indices=t(-5, 0, 1), num_weights=10, padding_idx=-1,
              scale_grad_by_freq=True)),
        ("default", dict(grad_output=torch.ones(3, 4), indices=t(2, 0, 1), num_weights=10, padding_idx=-1,
                         scale_grad_by_freq=False),
         dict(grad_output=torch.ones(2, 4), indices=t(2, 0, 1), num_weights=10, padding_idx=-1,
              scale_grad_by_freq=False))],
    "_embedding_bag": [("default", _bag(), _bag(offsets=t(0, -4099))), ("default", _bag(), _bag(offsets=t(2, 0))),
                       ("default", _bag(), _bag(indices=t(1, BIG, 3))), ("default", _bag(), _bag(mode=200)),
                       ("default", _bag(), _bag(offsets=t(0, 4099))),
                       # include_last_offset: the last offset closes the last bag; with none, max mode is a SIGSEGV
                       ("default", _bag(offsets=t(0, 1, 3), mode=2, include_last_offset=True),
                        _bag(offsets=t(0), mode=2, include_last_offset=True))],
    "embedding_bag": [("default", _bag(), _bag(offsets=t(1, 2)))],
    "gather": [("default", dict(self=X34, dim=1, index=t(0, 3).view(1, 2)), dict(self=X34, dim=1, index=t(0, BIG).view(1, 2))),
               ("default", dict(self=X34, dim=1, index=t(0).view(1, 1)), dict(self=X34, dim=5, index=t(0).view(1, 1)))],
    "scatter": [("value", dict(self=X34, dim=1, index=t(3).view(1, 1), value=1.0),
                 dict(self=X34, dim=1, index=t(BIG).view(1, 1), value=1.0))],
    "scatter_": [("value", dict(self=X34, dim=1, index=t(3).view(1, 1), value=1.0),
                  dict(self=X34, dim=1, index=t(-1).view(1, 1), value=1.0))],
    "scatter_add": [("default", dict(self=X34, dim=1, index=t(3).view(1, 1), src=torch.ones(1, 1)),
                     dict(self=X34, dim=1, index=t(BIG).view(1, 1), src=torch.ones(1, 1)))],
    "scatter_add_": [("default", dict(self=X34, dim=0, index=t(2).view(1, 1), src=torch.ones(1, 1)),
                      dict(self=X34, dim=0, index=t(3).view(1, 1), src=torch.ones(1, 1)))],
    "scatter_reduce": [("two", dict(self=X34, dim=1, index=t(3).view(1, 1), src=torch.ones(1, 1), reduce="amax"),
                        dict(self=X34, dim=1, index=t(BIG).view(1, 1), src=torch.ones(1, 1), reduce="amax"))],
    "scatter_reduce_": [  # torch_geometric's scatter softmax / aggregations: index expanded to src's shape
        ("two", dict(self=X34, dim=0, index=t(2, 0, 1, 2).view(4, 1).expand(4, 4), src=torch.ones(4, 4), reduce="sum"),
         dict(self=X34, dim=0, index=t(2, 0, 3, 2).view(4, 1).expand(4, 4), src=torch.ones(4, 4), reduce="sum")),
        ("two", dict(self=X34, dim=0, index=t(0).view(1, 1).expand(1, 4), src=torch.ones(1, 4), reduce="amax"),
         dict(self=X34, dim=0, index=t(0).view(1, 1).expand(1, 5), src=torch.ones(1, 5), reduce="amax")),
        ("two", dict(self=X34, dim=0, index=t(0).view(1, 1).expand(1, 4), src=torch.ones(1, 4), reduce="mean"),
         dict(self=X34, dim=0, index=t(0).view(1, 1).expand(2, 4), src=torch.ones(1, 4), reduce="mean")),
        ("two", dict(self=X34, dim=1, index=t(1).view(1, 1), src=torch.ones(1, 1), reduce="sum"),
         dict(self=X34, dim=1, index=t(1), src=torch.ones(1), reduce="sum"))],
    "index_reduce_": [("default", dict(self=X34, dim=0, index=t(2), source=torch.ones(1, 4), reduce="amax"),
                       dict(self=X34, dim=0, index=t(-4), source=torch.ones(1, 4), reduce="amax"))],
    "_fft_r2c": [("default", dict(self=X34, dim=[1], normalization=0, onesided=True),
                  dict(self=X34, dim=[2], normalization=0, onesided=True)),
                 ("default", dict(self=X34, dim=[0, 1], normalization=2, onesided=True),
                  dict(self=X34, dim=[1, -1], normalization=2, onesided=True)),
                 ("default", dict(self=X34, dim=[1], normalization=1, onesided=False),
                  dict(self=X34, dim=[1], normalization=200, onesided=False)),
                 ("default", dict(self=X34, dim=[1], normalization=0, onesided=True),
                  dict(self=torch.randn(3, 0), dim=[1], normalization=0, onesided=True)),
                 ("default", dict(self=X34, dim=[1], normalization=0, onesided=True),
                  dict(self=X34.to(torch.complex64), dim=[1], normalization=0, onesided=True))],
    "_fft_c2r": [("default", dict(self=torch.randn(3, 3, dtype=torch.complex64), dim=[1], normalization=2, last_dim_size=4),
                  dict(self=torch.randn(3, 3, dtype=torch.complex64), dim=[1], normalization=2, last_dim_size=BIG)),
                 ("default", dict(self=torch.randn(3, 3, dtype=torch.complex64), dim=[1], normalization=2, last_dim_size=5),
                  dict(self=torch.randn(3, 3, dtype=torch.complex64), dim=[1], normalization=2, last_dim_size=0)),
                 ("default", dict(self=torch.randn(3, 3, dtype=torch.complex64), dim=[0, 1], normalization=0, last_dim_size=4),
                  dict(self=torch.randn(3, 3), dim=[0, 1], normalization=0, last_dim_size=4))],
    "_fft_c2c": [("default", dict(self=torch.randn(3, 4, dtype=torch.complex64), dim=[0, 1], normalization=0, forward=True),
                  dict(self=torch.randn(3, 4, dtype=torch.complex64), dim=[], normalization=0, forward=True)),
                 ("default", dict(self=torch.randn(3, 4, dtype=torch.complex64), dim=[-1], normalization=1, forward=False),
                  dict(self=torch.randn(3, 4, dtype=torch.complex64), dim=[0, 1, 2], normalization=1, forward=False))],
    "unfold_backward": [("default", dict(grad_in=torch.ones(2, 3, 4), input_sizes=[2, 10], dim=1, size=4, step=3),
                         dict(grad_in=torch.ones(2, 3, 4), input_sizes=[2, BIG], dim=1, size=4, step=3)),
                        ("default", dict(grad_in=torch.ones(2, 3, 4), input_sizes=[2, 10], dim=1, size=4, step=3),
                         dict(grad_in=torch.ones(2, 3, 4), input_sizes=[2, 10], dim=1, size=4, step=0))],
    "index_copy_": [("default", dict(self=X34, dim=1, index=t(3), source=torch.ones(3, 1)),
                     dict(self=X34, dim=1, index=t(BIG), source=torch.ones(3, 1)))],
    "_is_all_true": [("default", dict(self=torch.ones(3, dtype=torch.bool)), dict(self=torch.ones(3)))],
    "index_select": [("default", dict(self=X34, dim=0, index=t(2, -3)), dict(self=X34, dim=0, index=t(BIG)))],
    "index_add": [("default", dict(self=X34, dim=0, index=t(2), source=torch.ones(1, 4)),
                   dict(self=X34, dim=0, index=t(BIG), source=torch.ones(1, 4)))],
    "index_add_": [("default", dict(self=X34, dim=0, index=t(2), source=torch.ones(1, 4)),
                    dict(self=X34, dim=0, index=t(2, 1), source=torch.ones(1, 4)))],
    "index_copy": [("default", dict(self=X34, dim=0, index=t(2), source=torch.ones(1, 4)),
                    dict(self=X34, dim=0, index=t(BIG), source=torch.ones(1, 4)))],
    "index_fill": [("int_Scalar", dict(self=X34, dim=0, index=t(2), value=1.0), dict(self=X34, dim=0, index=t(BIG), value=1.0))],
    "index_fill_": [("int_Scalar", dict(self=X34, dim=1, index=t(3), value=1.0), dict(self=X34, dim=1, index=t(4), value=1.0))],
    "index_reduce": [("default", dict(self=X34, dim=0, index=t(2), source=torch.ones(1, 4), reduce="amax"),
                      dict(self=X34, dim=0, index=t(BIG), source=torch.ones(1, 4), reduce="amax"))],
    "take": [("default", dict(self=X34, index=t(11, -12)), dict(self=X34, index=t(BIG)))],
    "index": [("Tensor", dict(self=X34, indices=[t(2), None]), dict(self=X34, indices=[t(BIG)])),
              ("Tensor", dict(self=X34, indices=[torch.ones(3, 4, dtype=torch.bool)]),
               dict(self=X34, indices=[torch.ones(3, 5, dtype=torch.bool)]))],
    "index_put": [("default", dict(self=X34, indices=[t(2)], values=torch.ones(4)),
                   dict(self=X34, indices=[t(BIG)], values=torch.ones(4)))],
    "index_put_": [("default", dict(self=X34, indices=[None, t(3)], values=torch.ones(3)),
                    dict(self=X34, indices=[None, t(4)], values=torch.ones(3)))],
    "split_with_sizes": [("default", dict(self=torch.randn(3), split_sizes=[1, 2]),
                          dict(self=torch.randn(3), split_sizes=[5, -2]))],
    "unsafe_split_with_sizes": [("default", dict(self=torch.randn(3), split_sizes=[3, 0]),
                                 dict(self=torch.randn(3), split_sizes=[1, 1]))],
    "split": [("Tensor", dict(self=torch.randn(3), split_size=2), dict(self=torch.randn(3), split_size=0)),
              ("Tensor", dict(self=torch.randn(3), split_size=2), dict(self=torch.randn(3), split_size=1, dim=3))],
    "unsafe_split": [("Tensor", dict(self=torch.randn(3), split_size=2), dict(self=torch.randn(3), split_size=-1))],
    "unbind": [("int", dict(self=torch.randn(3, 2)), dict(self=torch.randn(1).expand(10**7, 1)))],
    "mkldnn_rnn_layer": [("default", _rnn(8), _rnn(1000)), ("default", _rnn(8), _rnn(8, w0=16))],
    "div": [("Tensor_mode", dict(self=t(I64_MIN), other=t(-2), rounding_mode="trunc"),
             dict(self=t(I64_MIN), other=t(-1), rounding_mode="trunc")),
            ("Scalar_mode", dict(self=t(-(2**31), dtype=torch.int32), other=-2,
                                 rounding_mode="floor"),
             dict(self=t(-(2**31), dtype=torch.int32), other=-1, rounding_mode="trunc")),
            ("Tensor_mode", dict(self=t(I64_MIN), other=t(-1.0, dtype=torch.float32), rounding_mode="trunc"),
             dict(self=t(3), other=t(0), rounding_mode="trunc")),
            ("Tensor_mode", dict(self=t(3), other=t(0)), dict(self=t(3), other=t(0), rounding_mode="floor"))],
    "div_": [("Scalar_mode", dict(self=t(7), other=2, rounding_mode="trunc"), dict(self=t(7), other=0, rounding_mode="trunc"))],
    "floor_divide": [("Scalar", dict(self=t(7), other=2), dict(self=t(7), other=0))],
    "remainder": [("Tensor", dict(self=t(7, I64_MIN), other=t(2, 3)), dict(self=t(7, I64_MIN), other=t(2, -1))),
                  ("Scalar_Tensor", dict(self=5, other=t(2)), dict(self=5, other=t(0)))],
    "fmod": [("Tensor", dict(self=t(7), other=t(2)), dict(self=t(7), other=t(0)))],
    "_scaled_dot_product_flash_attention_for_cpu": [
        ("default", dict(query=Q, key=Q, value=Q), dict(query=Q, key=torch.randn(1, 2, 0, 8), value=torch.randn(1, 2, 0, 8))),
        ("default", dict(query=Q, key=Q, value=Q), dict(query=torch.randn(1, 2, 0, 8), key=Q, value=Q)),
        ("default", dict(query=Q, key=Q, value=Q), dict(query=Q, key=Q, value=torch.randn(1, 2, 5, 8))),
        ("default", dict(query=Q, key=Q, value=Q, attn_mask=torch.zeros(1, 1, 4, 4)),
         dict(query=Q, key=Q, value=Q, attn_mask=torch.zeros(1, 1, 3, 4)))],
    "_scaled_dot_product_flash_attention": [("default", dict(query=Q, key=Q, value=Q),
                                             dict(query=Q, key=torch.randn(1, 2, 0, 8), value=torch.randn(1, 2, 0, 8)))],
    "_scaled_dot_product_efficient_attention": [
        ("default", dict(query=Q, key=Q, value=Q, attn_bias=None, compute_log_sumexp=False),
         dict(query=Q, key=Q, value=Q, attn_bias=torch.zeros(2, 1, 1, 1), compute_log_sumexp=False))],
    "_scaled_dot_product_cudnn_attention": [("default", dict(query=Q, key=Q, value=Q),
                                             dict(query=Q[..., :0], key=Q, value=Q))],
    "native_group_norm": [
        ("default", dict(input=torch.randn(2, 4, 3), N=2, C=4, HxW=3, group=2, eps=1e-5),
         dict(input=torch.randn(2, 4, 3), N=200, C=4, HxW=3, group=2, eps=1e-5)),
        ("default", dict(input=torch.randn(2, 4, 3), N=2, C=4, HxW=3, group=2, eps=1e-5),
         dict(input=torch.randn(2, 4, 3), N=2, C=4, HxW=3, group=0, eps=1e-5))],
    "grid_sampler_2d": [("default", dict(interpolation_mode=1, padding_mode=2), dict(interpolation_mode=200, padding_mode=0)),
                        ("default", dict(interpolation_mode=0, padding_mode=0), dict(interpolation_mode=0, padding_mode=-1))],
    "_cdist_forward": [("default", dict(compute_mode=None), dict(compute_mode=200))],
    "cdist": [("default", dict(compute_mode=2), dict(compute_mode=3))],
}
# every loss whose `reduction` is an int code: the same pair
for _p in opchecks.REDUCTION_PACKETS:
    CASES[_p] = [(next(o for o in getattr(torch.ops.aten, _p).overloads() if "out" not in o),
                  dict(reduction=1), dict(reduction=200))]


# issue 37: batch-norm statistics per channel, upsample scales, _grouped_mm offsets that cover what they group
X4 = torch.randn(4, 3, 2, 2)
_BN_GOOD = dict(input=X4, weight=torch.ones(3), bias=torch.zeros(3), running_mean=torch.zeros(3),
                running_var=torch.ones(3), training=True, momentum=0.1, eps=1e-5)
_BN_BAD = {**_BN_GOOD, "running_mean": torch.zeros(1), "running_var": torch.ones(1)}
for _p, _ov in (("native_batch_norm", "default"), ("_native_batch_norm_legit", "default"),
                ("_native_batch_norm_legit_functional", "default")):
    CASES[_p] = [(_ov, _BN_GOOD, _BN_BAD)]
CASES["_native_batch_norm_legit_no_training"] = [
    ("default", {k: v for k, v in _BN_GOOD.items() if k != "training"},
     {k: v for k, v in _BN_BAD.items() if k != "training"})]
_BN_EVAL_BWD = dict(grad_out=X4, input=X4, weight=torch.ones(3), running_mean=torch.zeros(3),
                    running_var=torch.ones(3), save_mean=torch.zeros(0), save_invstd=torch.zeros(0), train=False)
CASES["native_batch_norm_backward"] = [
    ("default", _BN_EVAL_BWD, dict(grad_out=X4, input=X4, weight=torch.ones(1))),
    # in train mode the kernel reads the saved statistics: empty ones are a SIGSEGV
    ("default", {**_BN_EVAL_BWD, "save_mean": torch.zeros(3), "save_invstd": torch.ones(3), "train": True},
     {**_BN_EVAL_BWD, "train": True})]
_LN = dict(grad_out=torch.randn(8, 4), input=torch.randn(8, 4), normalized_shape=[4], mean=torch.zeros(8, 1),
           rstd=torch.ones(8, 1), weight=torch.ones(4), bias=torch.zeros(4), output_mask=[True, True, True])
CASES["native_layer_norm_backward"] = [
    ("default", _LN, {**_LN, "mean": torch.zeros(1), "rstd": torch.ones(1)}),  # reads the heap into grad_weight
    ("default", _LN, {**_LN, "grad_out": torch.randn(1, 4)}),
    ("default", _LN, {**_LN, "normalized_shape": [8, 4, 1]}),
    ("default", _LN, {**_LN, "weight": torch.ones(1)})]
for _p in ("_log_softmax_backward_data", "_softmax_backward_data"):
    CASES[_p] = [("default", dict(grad_output=X34, output=X34, dim=1, input_dtype=torch.float32),
                  dict(grad_output=X34, output=X34[:1], dim=1, input_dtype=torch.float32))]
_SPD = torch.eye(4).expand(3, 4, 4)
CASES["_cholesky_solve_helper"] = [
    ("default", dict(self=torch.ones(3, 4, 2), A=_SPD, upper=False), dict(self=torch.ones(1, 4, 2), A=_SPD, upper=False)),
    ("default", dict(self=torch.ones(3, 4, 2), A=_SPD, upper=False), dict(self=torch.ones(3, 2, 2), A=_SPD, upper=False))]
_UP = {"upsample_nearest1d": 1, "upsample_linear1d": 1, "upsample_nearest2d": 2, "upsample_bilinear2d": 2,
       "upsample_bicubic2d": 2, "upsample_nearest3d": 3, "upsample_trilinear3d": 3}
for _p, _n in _UP.items():
    _x = torch.randn(1, 1, *[2] * _n)
    _names = {1: ["scales"], 2: ["scales_h", "scales_w"], 3: ["scales_d", "scales_h", "scales_w"]}[_n]
    CASES[_p] = [("default", dict(self=_x, output_size=[4] * _n, **dict.fromkeys(_names, 2.0)),
                  dict(self=_x, output_size=[4] * _n, **dict.fromkeys(_names, float("nan")))),
                 ("vec", dict(input=_x, output_size=None, scale_factors=[2.0] * _n),
                  dict(input=_x, output_size=None, scale_factors=[-1.0] * _n))]
_OFFS = torch.tensor([2, 6], dtype=torch.int32)
CASES["_grouped_mm"] = [
    ("default", dict(self=torch.randn(6, 4), mat2=torch.randn(2, 4, 4), offs=_OFFS),
     dict(self=torch.randn(6, 4), mat2=torch.randn(2, 4, 4), offs=torch.tensor([2, 4], dtype=torch.int32))),
    ("default", dict(self=torch.randn(6, 4), mat2=torch.randn(2, 4, 4), offs=_OFFS),
     dict(self=torch.randn(6, 4), mat2=torch.randn(2, 4, 4), offs=torch.tensor([4, 2], dtype=torch.int32)))]


# issue 38: derivative kernels that `autograd.grad(create_graph=True)` runs as forward ops (WGAN-GP's penalty)
_G, _G5 = torch.ones(3, 4), torch.ones(3, 5)
_ACT = {"hardtanh_backward": dict(min_val=-1.0, max_val=1.0), "leaky_relu_backward": dict(negative_slope=0.01,
        self_is_result=False), "gelu_backward": {}, "softplus_backward": dict(beta=1.0, threshold=20.0),
        "silu_backward": {}, "mish_backward": {}, "hardsigmoid_backward": {}, "hardswish_backward": {},
        "softshrink_backward": dict(lambd=0.5), "logit_backward": {}}
for _p, _kw in _ACT.items():
    CASES[_p] = [("default", dict(grad_output=_G, self=X34, **_kw), dict(grad_output=_G5, self=X34, **_kw)),
                 # vmap(jacrev(f)) passes a batch of basis vectors against the saved input: broadcasting is fine
                 ("default", dict(grad_output=torch.ones(3, 2, 4), self=X34[:, None], **_kw),
                  dict(grad_output=torch.ones(3, 2, 4), self=torch.randn(2, 3, 4), **_kw))]
CASES["hardshrink_backward"] = [("default", dict(grad_out=_G, self=X34, lambd=0.5), dict(grad_out=_G5, self=X34, lambd=0.5))]
for _p in ("sigmoid_backward", "tanh_backward"):
    CASES[_p] = [("default", dict(grad_output=_G, output=X34), dict(grad_output=_G5, output=X34))]
CASES["elu_backward"] = [("default", dict(grad_output=_G, alpha=1.0, scale=1.0, input_scale=1.0, is_result=False,
                                          self_or_result=X34),
                          dict(grad_output=_G5, alpha=1.0, scale=1.0, input_scale=1.0, is_result=False,
                               self_or_result=X34))]
_S = torch.tensor(1.0)
_LOSS = {"mse_loss_backward": {}, "smooth_l1_loss_backward": dict(beta=1.0), "huber_loss_backward": dict(delta=1.0),
         "soft_margin_loss_backward": {}, "binary_cross_entropy_backward": dict(weight=None)}
for _p, _kw in _LOSS.items():
    CASES[_p] = [("default", dict(grad_output=_S, self=X34, target=X34, reduction=1, **_kw),
                  dict(grad_output=_S, self=X34, target=X34, reduction=200, **_kw)),
                 ("default", dict(grad_output=_G, self=X34, target=X34, reduction=0, **_kw),
                  dict(grad_output=_S, self=X34, target=torch.ones(3, 1), reduction=1, **_kw)),
                 ("default", dict(grad_output=_G, self=X34, target=X34, reduction=0, **_kw),
                  dict(grad_output=_G5, self=X34, target=X34, reduction=0, **_kw))]
CASES["binary_cross_entropy_backward"].append(
    ("default", dict(grad_output=_S, self=X34.sigmoid(), target=X34.sigmoid(), weight=torch.ones(3, 4), reduction=1),
     dict(grad_output=_S, self=X34.sigmoid(), target=X34.sigmoid(), weight=torch.ones(2, 4), reduction=1)))


# open world: MAML's inner loop on a CNN differentiates cross-entropy and max pooling (their indices are written to)
_SC, _Y = torch.randn(4, 3), torch.tensor([0, 2, 1, -100])
_NLL = dict(grad_output=_S, self=_SC, target=_Y, weight=None, reduction=1, ignore_index=-100, total_weight=_S)
CASES["nll_loss_backward"] = [("default", _NLL, {**_NLL, "target": torch.tensor([0, 2, 1, 3])}),
                              ("default", _NLL, {**_NLL, "target": torch.tensor([0, 2, 1, -1])}),
                              ("default", _NLL, {**_NLL, "target": _Y[:3]}),
                              ("default", _NLL, {**_NLL, "weight": torch.ones(2)}),
                              ("default", _NLL, {**_NLL, "reduction": 200})]
_NLL2 = dict(grad_output=_S, self=torch.randn(2, 3, 2, 2), target=torch.zeros(2, 2, 2, dtype=torch.long), weight=None,
             reduction=1, ignore_index=-100, total_weight=_S)
CASES["nll_loss2d_backward"] = [("default", _NLL2, {**_NLL2, "target": torch.full((2, 2, 2), 3)}),
                                ("default", _NLL2, {**_NLL2, "grad_output": torch.ones(2, 2)})]
_XP = torch.randn(1, 2, 4, 4)
_PO, _PI = torch.ops.aten.max_pool2d_with_indices(_XP, [2, 2], [2, 2])
_MP = dict(grad_output=torch.ones_like(_PO), self=_XP, kernel_size=[2, 2], stride=[2, 2], padding=[0, 0],
           dilation=[1, 1], ceil_mode=False, indices=_PI)
CASES["max_pool2d_with_indices_backward"] = [("default", _MP, {**_MP, "indices": _PI + 16}),
                                             ("default", _MP, {**_MP, "indices": _PI - 17}),
                                             ("default", _MP, {**_MP, "indices": _PI[:, :1]})]
CASES["_adaptive_avg_pool2d_backward"] = [("default", dict(grad_output=torch.ones(1, 2, 2, 2), self=_XP),
                                           dict(grad_output=torch.ones(5, 2, 2, 2), self=_XP))]
_AP = dict(grad_output=torch.ones(1, 2, 2, 2), self=_XP, kernel_size=[2, 2], stride=[2, 2], padding=[0, 0],
           ceil_mode=False, count_include_pad=True, divisor_override=None)
CASES["avg_pool2d_backward"] = [("default", _AP, {**_AP, "grad_output": torch.ones(1, 3, 2, 2)}),
                                ("default", _AP, {**_AP, "divisor_override": -1})]

_G23 = torch.ones(2, 3)
CASES["slice_backward"] = [
    ("default", dict(grad_output=torch.ones(2, 1), input_sizes=[2, 3], dim=1, start=0, end=1, step=1),
     dict(grad_output=torch.ones(2, 1), input_sizes=[2, 3], dim=5, start=0, end=1, step=1)),
    ("default", dict(grad_output=torch.ones(2, 1), input_sizes=[2, 3], dim=1, start=0, end=1, step=1),
     dict(grad_output=torch.ones(1, 1), input_sizes=[2, 3], dim=1, start=0, end=1, step=1)),
    ("default", dict(grad_output=torch.ones(2, 1), input_sizes=[2, 3], dim=1, start=0, end=1, step=1),
     dict(grad_output=torch.ones(2, 1), input_sizes=[2, -3], dim=1, start=0, end=1, step=1))]
CASES["select_backward"] = [("default", dict(grad_output=torch.ones(2), input_sizes=[2, 3], dim=1, index=2),
                             dict(grad_output=torch.ones(2), input_sizes=[2, 3], dim=1, index=BIG))]
CASES["diagonal_backward"] = [("default", dict(grad_output=torch.ones(2), input_sizes=[2, 3], offset=0, dim1=0, dim2=1),
                               dict(grad_output=torch.ones(3), input_sizes=[2, 3], offset=0, dim1=0, dim2=1))]

# open world: pack_padded_sequence reads lengths[0] time steps of its input unchecked
_PK = dict(input=torch.randn(3, 5, 4), lengths=torch.tensor([5, 3, 2]), batch_first=True)
CASES["_pack_padded_sequence"] = [("default", _PK, {**_PK, "lengths": torch.tensor([9, 3, 2])}),
                                  ("default", _PK, {**_PK, "batch_first": False}),
                                  ("default", _PK, {**_PK, "lengths": torch.tensor([[5, 3, 2]])})]

CASES["affine_grid_generator"] = [
    ("default", dict(theta=torch.randn(2, 2, 3), size=[2, 1, 4, 4], align_corners=False),
     dict(theta=torch.randn(2, 3, 4), size=[2, 1, 4, 4], align_corners=False)),
    ("default", dict(theta=torch.randn(2, 2, 3), size=[2, 1, 4, 4], align_corners=False),
     dict(theta=torch.randn(2, 2, 3), size=[2, 1, -4, 4], align_corners=False))]
for _p in ("_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"):
    _x = torch.randn(1, 1, 4, 4)
    CASES[_p] = [("default", dict(self=_x, output_size=[2, 2], align_corners=False, scales_h=0.5, scales_w=0.5),
                  dict(self=_x, output_size=[2, 2], align_corners=False, scales_h=float("nan"), scales_w=0.5)),
                 ("default", dict(self=_x, output_size=[2, 2], align_corners=False, scales_h=0.5, scales_w=0.5),
                  dict(self=_x, output_size=[2, 2], align_corners=False, scales_h=0.5, scales_w=1e-9))]

CASES["_pdist_forward"] = [("default", dict(self=torch.randn(5, 3), p=2.0), dict(self=torch.randn(2, 5, 3), p=2.0)),
                           ("default", dict(self=torch.randn(5, 3), p=2.0), dict(self=torch.randn(5, 3), p=float("nan")))]

# round 5 (formats/layoutchecks.py): kernels that read an argument as one dense block, whatever its strides
_V, _G1 = torch.randn(6, 4), torch.ones(6, 1)
CASES["_weight_norm_interface"] = [("default", dict(v=_V, g=_G1, dim=0), dict(v=_V, g=torch.ones(1, 1).expand(6, 1), dim=0)),
                                   ("default", dict(v=_V, g=_G1, dim=0), dict(v=torch.randn(4, 6).t(), g=_G1, dim=0))]
_GN = dict(input=torch.randn(2, 6, 3), weight=torch.ones(6), bias=torch.zeros(6), N=2, C=6, HxW=3, group=2, eps=1e-5)
CASES["native_group_norm"] += [("default", _GN, {**_GN, "weight": torch.ones(1).expand(6)}),
                               ("default", _GN, {**_GN, "bias": torch.zeros(12)[::2]})]
_LNB = dict(grad_out=torch.ones(8, 4), input=torch.ones(8, 4), normalized_shape=[4], mean=torch.zeros(8, 1),
            rstd=torch.ones(8, 1), weight=torch.ones(4), bias=torch.zeros(4), output_mask=[True, True, True])
CASES["native_layer_norm_backward"] += [("default", _LNB, {**_LNB, "rstd": torch.ones(1, 1).expand(8, 1)}),
                                        ("default", _LNB, {**_LNB, "mean": torch.zeros(16, 1)[::2]})]
_QKV = torch.randn(1, 2, 4, 8)
CASES["_scaled_dot_product_flash_attention_for_cpu"] += [
    ("default", dict(query=_QKV.transpose(1, 2).contiguous().transpose(1, 2), key=_QKV, value=_QKV),
     dict(query=torch.randn(1, 2, 4, 1).expand(1, 2, 4, 8), key=_QKV, value=_QKV)),
    ("default", dict(query=_QKV, key=_QKV, value=_QKV), dict(query=_QKV, key=_QKV, value=torch.randn(1, 2, 8, 4).mT))]


def _flat():
    for packet, cases in CASES.items():
        for k, (ov, good, bad) in enumerate(cases):
            yield pytest.param(packet, ov, good, bad, id=f"{packet}.{ov}-{k}")


def _check(packet: str, ov: str, kwargs: dict) -> None:
    op = getattr(getattr(torch.ops.aten, packet), ov)
    opchecks.check(op, packet, [], kwargs, opchecks.real_values)


def test_every_packet_of_the_table_has_cases():
    assert set(opchecks.RULES) <= set(CASES), sorted(set(opchecks.RULES) - set(CASES))
    for packet in opchecks.RULES:
        assert any(f"aten.{packet}." in n for n in ALLOWED_OPS), f"{packet} is in the table but not allowed"


@pytest.mark.parametrize(("packet", "ov", "good", "bad"), list(_flat()))
def test_the_table_refuses_what_the_kernel_would_trust(packet, ov, good, bad):
    _check(packet, ov, good)  # what an honest step records passes
    with pytest.raises(opchecks.Refused) as e:
        _check(packet, ov, bad)
    assert "\n" not in str(e.value) and not any(str(v) in str(e.value) for v in (BIG, I64_MIN, 4099))


def test_in_the_dry_run_values_are_checked_only_where_they_are_stored():
    """On the meta device an index tensor's values are unknown: its literals are still checked, its values
    are left to the replay (which has them)."""
    meta = t(BIG).to("meta")
    op = torch.ops.aten.embedding.default
    opchecks.check(op, "embedding", [W.to("meta"), meta], {}, lambda x: None)  # nothing known: nothing refused
    with pytest.raises(opchecks.Refused):
        opchecks.check(op, "embedding", [W.to("meta"), meta], {}, lambda x: t(BIG) if x is meta else None)
    with pytest.raises(opchecks.Refused):
        opchecks.check(op, "embedding", [W.to("meta"), meta, BIG], {}, lambda x: None)  # padding_idx: a literal


def test_no_allowed_overload_computes_on_plain_values():
    """`remainder.int`, `gcd.int`, `add.Scalar`...: the dry run would run them for real on ints the file chose
    (remainder by zero is SIGFPE). Every allowed overload returns tensors."""
    for name in ALLOWED_OPS:
        _, packet, ov = name.split(".")
        schema = getattr(getattr(torch.ops.aten, packet), ov)._schema
        returns = [str(r.type) for r in schema.returns]
        assert any("Tensor" in r for r in returns), name
        assert all("Tensor" in r or r in ("int", "SymInt") for r in returns), name
    for name in ("aten.remainder.int", "aten.gcd.int", "aten.add.int", "aten.div.float", "aten.to.prim_dtype",
                 "aten.floor.Scalar", "aten.sort.int"):
        assert name not in ALLOWED_OPS, name
