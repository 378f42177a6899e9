"""Argument checks for derivative kernels that a step runs as *forward* ops: `torch.autograd.grad(...,
create_graph=True)` (WGAN-GP's gradient penalty, input-gradient regularisers, physics-informed losses, MAML's
inner loop) puts the activations', losses' and poolings' `*_backward` kernels into the step program.

They join `opchecks.RULES` (same `Call`, same `Refused`) when this module is imported; formats/dryrun.py and
formats/stepmodel.py, the two places that run the table, import it. Most of these kernels are elementwise and
check their own broadcasting, so the checks ask for what autograd always passes: a gradient of exactly the
shape it differentiates. Two read *indices* from a tensor and trust them: `nll_loss_backward` writes
`grad_input[i][target[i]]` (the CPU kernel checks the range; these checks do not rely on it), and
`max_pool2d_with_indices_backward` writes `grad_input[indices[j]]` with no bounds check at all (an index past
the plane is a heap write). `_adaptive_avg_pool2d_backward` sizes its loops from `grad_output`'s batch and channels
without comparing them with the input's (a mismatch corrupts the heap).
"""

from __future__ import annotations

import math

import torch

from nanreplay.formats.opchecks import Call, Refused, _enum_check, _in_range, _shape, rule

# ------------------------------------------------------------------ activations and losses (issue 38)

# packet -> the argument that the gradient must match in shape (autograd passes the gradient of exactly the tensor
# it differentiates; the kernels would broadcast anything else, which no recorded step does)
_POINTWISE_GRAD = {p: "self" for p in (
    "hardtanh_backward", "leaky_relu_backward", "gelu_backward", "softplus_backward", "silu_backward", "mish_backward",
    "hardsigmoid_backward", "hardswish_backward", "softshrink_backward", "logit_backward")} | {
    "sigmoid_backward": "output", "tanh_backward": "output", "elu_backward": "self_or_result"}

for _p in ("mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward", "soft_margin_loss_backward",
           "binary_cross_entropy_backward", "nll_loss_backward", "nll_loss2d_backward"):
    rule(_p)(_enum_check(_p, "reduction", frozenset({0, 1, 2})))


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether shapes a and b broadcast together (plain ints: a check runs inside the replay's op recorder)."""
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(a), reversed(b), strict=False))


@rule(*_POINTWISE_GRAD, "hardshrink_backward")
def _pointwise_grad(call: Call) -> None:
    """An activation's derivative under `create_graph=True` (WGAN-GP's penalty): a gradient per input value, or
    one that broadcasts against the input — torch.func's `vmap(jacrev(f))` (a contractive penalty) passes a batch of
    basis vectors [N, K, D] against the saved [N, 1, D]. The kernel is elementwise (TensorIterator) and broadcasts
    safely; shapes that do not broadcast are no step's."""
    packet = call.name.split(".")[1]
    g = call["grad_out"] if packet == "hardshrink_backward" else call["grad_output"]
    x = call[_POINTWISE_GRAD.get(packet, "self")]
    if isinstance(g, torch.Tensor) and isinstance(x, torch.Tensor) and not _broadcast(_shape(g), _shape(x)):
        raise Refused(f"the gradient is {list(_shape(g))}, which does not broadcast against {list(_shape(x))}")


@rule("mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward", "soft_margin_loss_backward",
      "binary_cross_entropy_backward")
def _loss_grad(call: Call) -> None:
    """A loss's derivative: input and target of one shape (a weight, where given, too); the incoming gradient is
    the loss's (a scalar when reduced, else one per element)."""
    x, y, g, w = call["self"], call["target"], call["grad_output"], call["weight"]
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and _shape(x) != _shape(y):
        raise Refused("input and target differ in shape")
    if isinstance(w, torch.Tensor) and isinstance(x, torch.Tensor) and _shape(w) != _shape(x):
        raise Refused("the weight is not the input's shape")
    if isinstance(g, torch.Tensor) and isinstance(x, torch.Tensor) and g.numel() != 1 and _shape(g) != _shape(x):
        raise Refused("the incoming gradient is neither a scalar nor the input's shape")


# ------------------------------------------------------------------ cross-entropy and pooling (MAML's inner loop)


@rule("nll_loss_backward", "nll_loss2d_backward")
def _nll_grad(call: Call) -> None:
    """cross_entropy's derivative (MAML differentiates its inner loss): one class index per sample (or pixel), each
    in [0, C) or the ignore_index; a weight of one value per class; the incoming gradient a scalar (reduced) or one
    per target."""
    x, y, g, w, tw = call["self"], call["target"], call["grad_output"], call["weight"], call["total_weight"]
    xs = _shape(x)
    if not 1 <= len(xs) <= 4:
        raise Refused("the input must be scores of shape (C), (N, C) or (N, C, H, W)")
    c = xs[0] if len(xs) == 1 else xs[1]
    want = () if len(xs) == 1 else xs[:1] + xs[2:]
    if isinstance(y, torch.Tensor) and _shape(y) != want:
        raise Refused(f"the target is {list(_shape(y))}, not one class per sample {list(want)}")
    if isinstance(w, torch.Tensor) and _shape(w) != (c,):
        raise Refused(f"the weight is {list(_shape(w))}, not one value per class ({c})")
    if isinstance(tw, torch.Tensor) and tw.numel() != 1:
        raise Refused("total_weight must be one number")
    if isinstance(g, torch.Tensor) and g.numel() != 1 and _shape(g) != want:
        raise Refused("the incoming gradient is neither a scalar nor one per target")
    ignore = call["ignore_index"]
    v = call.value(y)
    if v is not None and v.numel() and not v.is_floating_point() and isinstance(ignore, int):
        kept = v[v != ignore]
        if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= c):
            raise Refused(f"the target holds classes outside [0, {c})")


@rule("max_pool2d_with_indices_backward")
def _max_pool_grad(call: Call) -> None:
    """The kernel adds each gradient at `indices[j]` of its input plane without a bounds check: every index must lie
    in the plane (H x W of the input), and there is one index per gradient value."""
    x, g, idx = call["self"], call["grad_output"], call["indices"]
    xs = _shape(x)
    if len(xs) not in (3, 4):
        raise Refused("the input must be (C, H, W) or (N, C, H, W)")
    if isinstance(idx, torch.Tensor) and isinstance(g, torch.Tensor) and _shape(idx) != _shape(g):
        raise Refused("indices must hold one index per gradient value")
    _in_range(call, idx, 0, math.prod(xs[-2:]), "indices")


@rule("avg_pool2d_backward", "_adaptive_avg_pool2d_backward")
def _avg_pool_grad(call: Call) -> None:
    """`_adaptive_avg_pool2d_backward` loops over grad_output's planes to write the input's: both must have the same
    leading (batch and channel) dimensions; avg_pool2d's kernel checks the gradient's shape itself."""
    x, g = call["self"], call["grad_output"]
    xs, gs = _shape(x), _shape(g)
    if len(xs) not in (3, 4) or len(gs) != len(xs):
        raise Refused("input and gradient must both be (C, H, W) or (N, C, H, W)")
    if gs[:-2] != xs[:-2]:
        raise Refused("the gradient's batch and channels differ from the input's")
    if call.name.split(".")[1] == "avg_pool2d_backward" and call["divisor_override"] is not None \
            and not (isinstance(call["divisor_override"], int) and call["divisor_override"] > 0):
        raise Refused("divisor_override must be positive")


# ------------------------------------------------------------------ views of a gradient (physics-informed losses)


def _wrap(d, n: int, what: str) -> int:
    if not isinstance(d, int) or not -max(n, 1) <= d < max(n, 1):
        raise Refused(f"{what} is outside the {n} dimensions of input_sizes")
    return d % max(n, 1)


@rule("slice_backward", "select_backward", "diagonal_backward")
def _view_grad(call: Call) -> None:
    """The derivative of a view (`du[:, :1]`, `du[:, 0]`, a Hessian's diagonal): zeros of `input_sizes` with the
    gradient written into the view. The sizes must be sizes, the view must exist in them, and the gradient must have
    the view's shape (the copy would broadcast anything smaller). Computed on plain ints: a check runs inside the
    replay's op recorder, where a tensor op would be recorded as the step's."""
    sizes, g = call["input_sizes"], call["grad_output"]
    if not isinstance(sizes, list) or not all(isinstance(n, int) and 0 <= n < 2**62 for n in sizes):
        raise Refused("input_sizes must be sizes")
    packet = call.name.split(".")[1]
    dims = ("dim1", "dim2") if packet == "diagonal_backward" else ("dim",)
    ds = [_wrap(call[d], len(sizes), d) for d in dims]
    view = list(sizes)
    if packet == "slice_backward":
        step, start, end = call["step"], call["start"], call["end"]
        if not isinstance(step, int) or step <= 0 or not all(v is None or isinstance(v, int) for v in (start, end)):
            raise Refused("start, end and step must be integers, step positive")
        view[ds[0]] = len(range(*slice(start, end, step).indices(sizes[ds[0]])))
    elif packet == "select_backward":
        i, n = call["index"], sizes[ds[0]]
        if not isinstance(i, int) or not -n <= i < n:
            raise Refused("index is outside the dimension it selects from")
        del view[ds[0]]
    else:
        off, (d1, d2) = call["offset"], ds
        if not isinstance(off, int) or d1 == d2:
            raise Refused("a diagonal needs an integer offset and two distinct dims")
        n1, n2 = sizes[d1], sizes[d2]
        length = max(0, min(n1, n2 - off) if off >= 0 else min(n1 + off, n2))
        view = [n for k, n in enumerate(sizes) if k not in (d1, d2)] + [length]
    if isinstance(g, torch.Tensor) and list(_shape(g)) != view:
        raise Refused(f"the gradient is {list(_shape(g))}, not the view's shape {view}")


# ------------------------------------------------------------------ other kernels that trust a companion argument
# (packed sequences, spatial transformers, pdist: here rather than in opchecks.py, which is at the size limit)


@rule("_pack_padded_sequence")
def _pack_padded(call: Call) -> None:
    """`pack_padded_sequence`: the kernel copies `lengths[0]` time steps of the input without comparing that with the
    input's length (a longer one reads past the input and returns batch sizes its data does not hold)."""
    x, lengths = call["input"], call["lengths"]
    xs = _shape(x)
    if len(xs) < 2:
        raise Refused("the input must be (T, B, *) or (B, T, *)")
    steps = xs[1] if call["batch_first"] else xs[0]
    if isinstance(lengths, torch.Tensor) and lengths.dim() != 1:
        raise Refused("lengths must be a vector")
    _in_range(call, lengths, 1, steps + 1, "lengths")


@rule("affine_grid_generator")
def _affine_grid(call: Call) -> None:
    """A spatial transformer's sampling grid: `size` is an image's (N, C, H, W) or a volume's (N, C, D, H, W), and
    theta one 2x3 (3x4) matrix per sample; the kernel is a matmul over a base grid of that size."""
    size, theta = call["size"], call["theta"]
    if not isinstance(size, list) or len(size) not in (4, 5) or not all(isinstance(n, int) and n >= 0 for n in size):
        raise Refused("size must be the (N, C, H, W) or (N, C, D, H, W) of an image")
    want = (size[0], 2, 3) if len(size) == 4 else (size[0], 3, 4)
    if isinstance(theta, torch.Tensor) and _shape(theta) != want:
        raise Refused(f"theta is {list(_shape(theta))}, not one {want[1]}x{want[2]} matrix per sample")


@rule("_pdist_forward")
def _pdist(call: Call) -> None:
    """`F.pdist`'s kernel, reached directly: torch's own wrapper checks what the kernel does not (a matrix of row
    vectors, a p-norm with p >= 0)."""
    p = call["p"]
    if len(_shape(call["self"])) != 2:
        raise Refused("the input must be a matrix of row vectors")
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not p >= 0:
        raise Refused("p must be a non-negative number")
