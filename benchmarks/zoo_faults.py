"""The zoo's faults: what each one edits in a model's own code path, and the truth an analysis must find.

A *site* fault is a user's line, run in a forward pre-hook at a randomly chosen module on the forward
path (so the module running it is that module): the hook edits the module's input (one sample at the domain
edge) and applies the line. The line marked `# SITE: <kind>` is the line a user would change. Weight, data
and optimizer faults edit a weight, the batch, the learning rate or the optimizer, never nanreplay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MATMULS = frozenset({"aten.addmm", "aten.mm", "aten.bmm", "aten.linear", "aten.matmul", "aten.convolution",
                     "aten._convolution", "aten.baddbmm", "aten.addmv", "aten.mv"})


@dataclass(frozen=True)
class Kind:
    name: str
    how: str  # site | weight | data | lr | optimizer | schedule
    ops: frozenset = frozenset()  # the culprit's forward op (packet) that must be named; empty: no op to name
    causes: frozenset = frozenset()  # the diagnosis causes of the fault's family
    triggers: frozenset = frozenset({"loss", "gradient"})
    fixes: frozenset = frozenset()  # fix kinds that are plausible for this fault
    precisions: tuple = ("fp32", "bf16")
    extra: dict = field(default_factory=dict)


KINDS = {k.name: k for k in (
    Kind("sqrt_zero", "site", frozenset({"aten.sqrt"}), frozenset({"sqrt_at_zero"}), frozenset({"gradient"}),
         frozenset({"epsilon", "clamp"})),
    Kind("rsqrt_zero", "site", frozenset({"aten.rsqrt"}), frozenset({"domain_edge", "division_by_zero", "sqrt_at_zero"}),
         fixes=frozenset({"epsilon", "clamp"})),
    Kind("log_zero", "site", frozenset({"aten.log"}), frozenset({"log_of_zero"}), fixes=frozenset({"epsilon", "clamp"})),
    Kind("div_zero", "site", frozenset({"aten.div"}), frozenset({"division_by_zero", "normalize_zero_norm"}),
         fixes=frozenset({"epsilon", "clamp"})),
    Kind("pow_zero", "site", frozenset({"aten.pow"}), frozenset({"pow_at_zero"}), frozenset({"gradient"}),
         frozenset({"epsilon", "clamp"})),
    Kind("acos_edge", "site", frozenset({"aten.acos"}), frozenset({"acos_asin_boundary"}), fixes=frozenset({"clamp"})),
    Kind("negative_variance", "site", frozenset({"aten.sqrt"}), frozenset({"sqrt_of_negative", "sqrt_cancellation"}),
         fixes=frozenset({"clamp", "epsilon", "correction", "stable_variance"}), precisions=("fp32",)),
    Kind("masked_row", "site", frozenset({"aten._softmax", "aten.softmax"}), frozenset({"softmax_all_masked"}),
         fixes=frozenset({"finite_mask_value", "double_where"})),
    Kind("masked_mean", "site", frozenset({"aten.div"}), frozenset({"empty_reduction", "masked_mean_empty", "division_by_zero"}),
         fixes=frozenset({"guard_empty_reduction", "epsilon", "clamp"})),
    Kind("fp16_overflow", "weight", MATMULS,
         frozenset({"fp16_overflow", "magnitude_overflow", "huge_values", "exploded_weights"}),
         fixes=frozenset({"bf16_or_grad_scaler", "restore_parameters", "lower_lr_clip_grads"}), precisions=("fp16",)),
    Kind("lr_spike", "lr", frozenset(), frozenset({"training_diverged", "exploded_weights", "update_overflow",
                                                  "optimizer_update", "huge_values", "fp16_overflow"}),
         frozenset({"loss", "gradient", "update", "grad_norm_overflow"}), frozenset({"lower_lr_clip_grads"}),
         precisions=("fp32",)),
    Kind("nan_sample", "data", frozenset(), frozenset({"nonfinite_input"}), frozenset({"loss", "gradient"}),
         frozenset({"clean_input"}), precisions=("fp32",)),
    Kind("adam_eps_half", "optimizer", frozenset(), frozenset({"optimizer_eps"}), frozenset({"update"}),
         frozenset({"epsilon", "bf16_or_grad_scaler"}), precisions=("half",)),
    Kind("inf_schedule", "schedule", frozenset(), frozenset({"nonfinite_lr"}), frozenset({"update"}),
         frozenset({"lr_schedule", "lower_lr_clip_grads"}), precisions=("fp32",)),
)}


# ---------------------------------------------------------------- the user's lines, one per site fault

def _negative_variance_value(n: int, dtype: torch.dtype) -> float:
    """A constant whose one-pass variance E[x^2] - E[x]^2 (+1e-5) rounds below zero over n values."""
    for k in range(2000):
        c = 1000.0 + 0.37 * k
        x = torch.full((n,), c, dtype=dtype)
        if float(x.pow(2).mean() - x.mean().pow(2) + 1e-5) < 0:
            return c
    return float("nan")


def edge(kind: str, x: torch.Tensor, sample: int) -> torch.Tensor:
    """The data edit: sample `sample` of this activation put at the domain edge of the fault's op. A mask
    multiplies (as masking does in real code), so the gradient still flows through that sample."""
    keep = torch.ones(x.shape[0], *([1] * (x.dim() - 1)), dtype=x.dtype)
    keep[sample] = 0
    if kind == "acos_edge":
        return x * keep + 10.0 * (1 - keep)
    if kind == "negative_variance":
        return x * keep + _negative_variance_value(x.shape[-1], x.dtype) * (1 - keep)
    if kind in ("sqrt_zero", "rsqrt_zero", "log_zero", "div_zero", "pow_zero"):
        return x * keep
    return x


def site(kind: str, x: torch.Tensor, sample: int) -> torch.Tensor:
    """The user's line for each site fault (the marked line is the one to change)."""
    if kind == "sqrt_zero":
        return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)  # SITE: sqrt_zero
    if kind == "rsqrt_zero":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # SITE: rsqrt_zero
    if kind == "log_zero":
        return x + 0.1 * torch.log(x.pow(2).mean(-1, keepdim=True))  # SITE: log_zero
    if kind == "div_zero":
        return x / x.abs().amax(-1, keepdim=True)  # SITE: div_zero
    if kind == "pow_zero":
        return x / (x.pow(2).mean(-1, keepdim=True).pow(0.5) + 1e-6)  # SITE: pow_zero
    if kind == "acos_edge":
        return x + 0.1 * torch.acos(x.mean(-1, keepdim=True).tanh() * 1.01)  # SITE: acos_edge
    if kind == "negative_variance":
        m = x.mean(-1, keepdim=True)
        return (x - m) / (x.pow(2).mean(-1, keepdim=True) - m.pow(2) + 1e-5).sqrt()  # SITE: negative_variance
    if kind == "masked_row":
        pad = torch.zeros(x.shape[:-1] + (x.shape[-2],), dtype=torch.bool)
        pad[sample] = True  # every key of this sample is padding
        scores = (x @ x.transpose(-1, -2)) / math.sqrt(x.shape[-1])
        att = F.softmax(scores.masked_fill(pad, float("-inf")), dim=-1)  # SITE: masked_row
        return x + att @ x
    if kind == "masked_mean":
        keep = torch.ones(x.shape, dtype=x.dtype)
        keep[sample] = 0  # nothing of this sample is kept
        return x - (x * keep).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True)  # SITE: masked_mean
    raise KeyError(kind)


def site_line(kind: str) -> int:
    """The line number of `# SITE: kind` in this file."""
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# SITE: {kind}"):
                return i
    raise KeyError(kind)


class SiteHook:
    """A forward pre-hook that, once switched on, applies the fault's line to the module's activation input."""

    def __init__(self, kind: str, sample: int, arg: int | str):
        self.kind, self.sample, self.arg, self.on = kind, sample, arg, False

    def __call__(self, module, args, kwargs):
        if not self.on:
            return None
        if isinstance(self.arg, int):
            args = list(args)
            args[self.arg] = site(self.kind, edge(self.kind, args[self.arg], self.sample), self.sample)
            return tuple(args), kwargs
        kwargs = dict(kwargs)
        kwargs[self.arg] = site(self.kind, edge(self.kind, kwargs[self.arg], self.sample), self.sample)
        return args, kwargs


def activation_arg(args: tuple, kwargs: dict) -> int | str | None:
    """Which argument of a module call is its activation: a float tensor that carries a gradient, ≥ 2-D."""
    for i, a in enumerate(args):
        if _activation(a):
            return i
    for k in ("hidden_states", "x", "input", "inputs_embeds"):
        if _activation(kwargs.get(k)):
            return k
    return None


def _activation(a) -> bool:
    return (isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad and a.dim() >= 2
            and a.shape[-1] >= 2 and a.shape[0] >= 2 and (a.dim() > 2 or a.shape[-2] >= 2))
