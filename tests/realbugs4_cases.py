"""Fixture module for tests/diagnose/test_real_bugs4.py (the model factories a snapshot is replayed with)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases import Registry, seeded

CASES = Registry(__name__)
case = CASES.case


class CovarianceHead(nn.Module):
    """A Gaussian NLL over a 2x2 covariance predicted entry by entry: a free off-diagonal term larger than the
    geometric mean of the variances makes the determinant negative, and torch.logdet is NaN there."""

    def __init__(self):
        super().__init__()
        self.cov = nn.Linear(3, 3)

    def forward(self, x):
        a, b, c = self.cov(x).unbind(1)
        cov = torch.stack([torch.stack([a.exp(), c], 1), torch.stack([c, b.exp()], 1)], 1)  # CULPRIT: matrix
        return 0.5 * torch.logdet(cov).mean()  # CULPRIT: logdet


def _indefinite_batch():
    x = torch.zeros(4, 3)
    x[2, 2] = 4.0  # this row's off-diagonal term is 4 * w + b, beyond exp(0) = 1 for the weight set below
    return {"x": x}


@case("logdet_indefinite", _indefinite_batch, cause="logdet_not_positive_definite", phase="forward", kind="nan")
@seeded
def covariance_head():
    m = CovarianceHead()
    with torch.no_grad():
        m.cov.weight.zero_()
        m.cov.bias.zero_()
        m.cov.weight[2, 2] = 1.0
    return m


class CombinationLikelihood(nn.Module):
    """A DROP-style head: the likelihood of a sign combination is the product of each number's sign probability,
    made on one line and logged on the next; a hundred factors near 1/3 underflow float32 to 0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        probs = torch.softmax(self.fc(x), dim=-1)[..., 0]
        likelihood = probs.prod(dim=1)  # CULPRIT: prod
        return -torch.log(likelihood).mean()  # CULPRIT: logprod


def product_batch(n: int = 100) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(2, n, 4, generator=g) * 0.1}


@case("log_of_product", product_batch, cause="log_of_product_underflow", phase="forward", kind="inf")
@seeded
def combination_likelihood():
    return CombinationLikelihood()


TEACHER = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0]), -1)


class ReverseKL(nn.Module):
    """Reverse-KL distillation at a low temperature: the student's softmax is kl_div's target, and some of its
    probabilities underflow to exactly 0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        student_p = F.softmax(self.fc(x) / 0.01, dim=-1)  # CULPRIT: softmax
        return F.kl_div(TEACHER.expand(x.shape[0], 5), student_p, reduction="batchmean")  # CULPRIT: kldiv


def kl_batch(scale: float = 30.0) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(3, 4, generator=g) * scale}


@case("reverse_kl", kl_batch, cause="kl_div_target_zero", phase="backward", kind="nan")
@seeded
def reverse_kl():
    return ReverseKL()


class SurvivalCurve(nn.Module):
    """A survival curve as the cumulative product of 1 - hazard over 200 intervals, logged on one line."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 200)

    def forward(self, x):
        keep = 0.5 * torch.sigmoid(self.fc(x))  # each factor near 1/4
        return -torch.log(torch.cumprod(keep, dim=1)).mean()  # CULPRIT: cumprod


@case("log_of_cumprod", lambda: {"x": torch.zeros(2, 4)}, cause="log_of_product_underflow", phase="forward",
      kind="inf")
@seeded
def survival_curve():
    return SurvivalCurve()
