"""One small fixture per row of the reformulation table (nanreplay/diagnose/forms.py), for
tests/diagnose/test_forms_table.py.

Each model computes its row's unstable composition on `h = x * scale` (and `k`, a second batch tensor: data
such as weights, an action, a target) on one line marked `# CULPRIT: <row>`. ROWS gives, per row, the batch
that drives the composition to its failure and a healthy batch the same line computes fine: the exact form
must make the first finite and leave the second unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases import Case, marker_line

IDX = torch.tensor([0, 0, 1, 1])  # two segments of two edges (a graph's edges grouped by target node)
TGT = torch.tensor([[1, 2, 3]])


class FormModel(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x, k):
        h = x * self.scale
        return getattr(self, self.name)(h, k)

    def softplus(self, h, k):
        return torch.log(1 + torch.exp(h)).sum()  # CULPRIT: softplus

    def logsumexp(self, h, k):  # a mixture density: weights k, components far from the sample underflow
        return -torch.log((k.view(2, 2) * torch.exp(-0.5 * h.view(2, 2) ** 2)).sum(-1)).mean()  # CULPRIT: logsumexp

    def log_softmax(self, h, k):
        return -(torch.log(torch.softmax(h * 10, -1)) * k).sum()  # CULPRIT: log_softmax

    def logsigmoid(self, h, k):
        return -torch.log(torch.sigmoid(h)).sum()  # CULPRIT: logsigmoid

    def log1mexp(self, h, k):
        return torch.log1p(-torch.exp(h)).sum()  # CULPRIT: log1mexp

    def xlogy(self, h, k):  # k is data (a probability of exactly 0) where the coefficient h is 0
        return (h * torch.log(k)).sum()  # CULPRIT: xlogy

    def xlog1py(self, h, k):  # a Beta policy's (beta - 1) * log(1 - a) at an action a of exactly 1, beta = 1
        return (h * torch.log1p(-k)).sum()  # CULPRIT: xlog1py

    def zero_times_inf(self, h, k):  # an entropy over logits masked with -inf where k == 0: p = 0, log p = -inf
        lp = torch.log_softmax(h.masked_fill(k == 0, float("-inf")), -1)
        return -(torch.exp(lp) * lp).sum()  # CULPRIT: zero_times_inf

    def bce_with_logits(self, h, k):
        return -(k * torch.log(p := torch.sigmoid(h)) + (1 - k) * torch.log(1 - p)).mean()  # CULPRIT: bce_with_logits

    def segment_softmax(self, h, k):
        e = torch.exp(h)  # CULPRIT: segment_softmax
        return (e / torch.zeros(2).index_add(0, IDX, e)[IDX] * k).sum()

    def finite_mask(self, h, k):
        s = h.view(2, 2).masked_fill(k.view(2, 2) == 0, float("-inf"))
        return (torch.softmax(s, -1) * h.view(2, 2)).sum()  # CULPRIT: finite_mask

    def ctc_infeasible(self, h, k):  # k[0]: the target's length; the input has 2 frames
        lp = (h.view(1, 1, 4) * torch.arange(4.0)).expand(2, 1, 4).log_softmax(-1)
        return F.ctc_loss(lp, TGT, torch.tensor([2]), k[:1].long())  # CULPRIT: ctc_infeasible

    def log_ratio_of_exps(self, h, k):  # NT-Xent written with exps: the first entry's softmax probability, logged
        return -torch.log(torch.exp(h[0]) / torch.exp(h).sum(-1))  # CULPRIT: log_ratio_of_exps

    def logcosh(self, h, k):  # the log-cosh loss of residuals h
        return torch.log(torch.cosh(h)).sum()  # CULPRIT: logcosh

    def log_of_product(self, h, k):  # a likelihood as a product of probabilities: tiny factors underflow it to 0
        return -torch.log(h.prod(0))  # CULPRIT: log_of_product

    def ratio_to_zero_target(self, h, k):  # a relative error (MAPE) with a target of exactly 0
        return ((h - k).abs() / k.abs()).mean()  # CULPRIT: ratio_to_zero_target


#  row: ((x, k) that fail, (x, k) that are healthy)
ROWS = {
    "softplus": (([100.0, 1.0, 2.0, 0.5], [1.0] * 4), ([3.0, 1.0, 2.0, 0.5], [1.0] * 4)),
    "logsumexp": (([1.0, 2.0, 30.0, 40.0], [0.5] * 4), ([1.0, 2.0, 0.3, 0.4], [0.5] * 4)),
    "log_softmax": (([1.0, 2.0, 30.0, 40.0], [1.0] * 4), ([0.1, 0.2, 0.3, 0.4], [1.0] * 4)),
    "logsigmoid": (([-200.0, 1.0, 2.0, 0.5], [1.0] * 4), ([-2.0, 1.0, 2.0, 0.5], [1.0] * 4)),
    "log1mexp": (([-1e-9, -1.0, -2.0, -0.5], [1.0] * 4), ([-0.1, -1.0, -2.0, -0.5], [1.0] * 4)),
    "xlogy": (([0.0, 1.0, 2.0, 0.5], [0.0, 0.5, 0.2, 0.1]), ([0.3, 1.0, 2.0, 0.5], [0.1, 0.5, 0.2, 0.1])),
    "xlog1py": (([0.0, 1.0, 2.0, 0.5], [1.0, 0.5, 0.2, 0.1]), ([0.3, 1.0, 2.0, 0.5], [0.9, 0.5, 0.2, 0.1])),
    "zero_times_inf": (([1.0, 2.0, 3.0, 0.5], [1.0, 1.0, 0.0, 1.0]), ([1.0, 2.0, 3.0, 0.5], [1.0] * 4)),
    "bce_with_logits": (([40.0, 1.0, -2.0, 0.5], [0.0, 1.0, 0.0, 1.0]), ([4.0, 1.0, -2.0, 0.5], [0.0, 1.0, 0.0, 1.0])),
    "segment_softmax": (([100.0, 1.0, 2.0, 0.5], [1.0, 2.0, 3.0, 4.0]), ([3.0, 1.0, 2.0, 0.5], [1.0, 2.0, 3.0, 4.0])),
    "finite_mask": (([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 0.0, 0.0]), ([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 0.0])),
    "ctc_infeasible": (([1.0, 1.0, 2.0, 0.5], [3.0, 0, 0, 0]), ([1.0, 1.0, 2.0, 0.5], [1.0, 0, 0, 0])),
    "log_ratio_of_exps": (([100.0, 1.0, 2.0, 0.5], [1.0] * 4), ([3.0, 1.0, 2.0, 0.5], [1.0] * 4)),
    "logcosh": (([100.0, 1.0, 2.0, 0.5], [1.0] * 4), ([3.0, 1.0, 2.0, 0.5], [1.0] * 4)),
    "log_of_product": (([1e-20, 1e-20, 1e-10, 0.5], [1.0] * 4), ([0.1, 0.2, 0.3, 0.4], [1.0] * 4)),
    "ratio_to_zero_target": (([1.0, 1.0, 2.0, 0.5], [0.0, 1.0, 1.0, 1.0]), ([1.0, 1.0, 2.0, 0.5], [2.0, 1.0, 1.0, 1.0])),
}


def _factory(name):
    def make():
        return FormModel(name)
    make.__name__ = f"form_{name}"
    return make


def batch(name: str, healthy: bool = False) -> dict:
    x, k = ROWS[name][1 if healthy else 0]
    return {"x": (torch.tensor(x), torch.tensor(k))}


CASES = {}
for _n in ROWS:
    globals()[f"form_{_n}"] = _factory(_n)
    CASES[_n] = Case(_n, __name__, f"form_{_n}", (lambda n: lambda: batch(n))(_n))


def CASES_LINE(name: str) -> int:  # noqa: N802 - read like a table
    """The line of `# CULPRIT: <name>` in this file."""
    return marker_line(name, Path(__file__))
