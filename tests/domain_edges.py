"""One small fixture per op with a singular or overflowing domain (tests/diagnose/test_domain_table.py).

Each model computes `op(x * scale) * keep` and sums it: `x` holds one value at the op's edge, `keep` is 0
there (a masked term), so forward makes NaN/Inf at the edge (0 × Inf = NaN reaches the loss) and a right fix
— the input moved off the edge — gives a loss that does not depend on the fix's ε. EDGES lists, per op, the
inputs and the cause the analysis must name: the specific rule where there is one, else the domain table's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cases import Case

#  op: (how the op is called on h, x holding the edge value first, expected cause)
EDGES = {
    "rsqrt": (lambda h: torch.rsqrt(h), [0.0, 1.0, 2.0, 0.5], "domain_edge"),
    "log1p": (lambda h: torch.log1p(h), [-1.0, 0.5, 1.0, 2.0], "domain_edge"),
    "atanh": (lambda h: torch.atanh(h), [1.0, 0.3, -0.2, 0.5], "domain_edge"),
    "erfinv": (lambda h: torch.erfinv(h), [1.0, 0.3, -0.2, 0.5], "domain_edge"),
    "acosh": (lambda h: torch.acosh(h), [0.5, 2.0, 3.0, 1.5], "domain_edge"),
    "logit": (lambda h: torch.logit(h), [0.0, 0.3, 0.7, 0.5], "domain_edge"),
    "lgamma": (lambda h: torch.lgamma(h), [0.0, 1.5, 2.5, 3.0], "domain_edge"),
    "digamma": (lambda h: torch.digamma(h), [0.0, 1.5, 2.5, 3.0], "domain_edge"),
    "polygamma": (lambda h: torch.polygamma(1, h), [0.0, 1.5, 2.5, 3.0], "domain_edge"),
    "fmod": (lambda h: torch.fmod(torch.ones_like(h) * 3, h), [0.0, 1.5, 2.5, 4.0], "domain_edge"),
    "remainder": (lambda h: torch.remainder(torch.ones_like(h) * 3, h), [0.0, 1.5, 2.5, 4.0], "domain_edge"),
    "expm1": (lambda h: torch.expm1(h), [100.0, 1.0, 2.0, 0.5], "domain_edge"),
    "cosh": (lambda h: torch.cosh(h), [100.0, 1.0, 2.0, 0.5], "domain_edge"),
    "sinh": (lambda h: torch.sinh(h), [100.0, 1.0, 2.0, 0.5], "domain_edge"),
    "exp2": (lambda h: torch.exp2(h), [200.0, 1.0, 2.0, 0.5], "domain_edge"),
    # ops with a rule of their own, hit the same way
    "log": (lambda h: torch.log(h), [0.0, 1.0, 2.0, 3.0], "log_of_zero"),
    "log2": (lambda h: torch.log2(h), [0.0, 1.0, 2.0, 3.0], "log_of_zero"),
    "log10": (lambda h: torch.log10(h), [0.0, 1.0, 2.0, 3.0], "log_of_zero"),
    "sqrt": (lambda h: torch.sqrt(h), [-1.0, 1.0, 2.0, 0.5], "sqrt_of_negative"),
    "pow": (lambda h: torch.pow(h, 0.5), [-1.0, 1.0, 2.0, 0.5], "pow_of_negative"),
    "acos": (lambda h: torch.acos(h), [1.5, 0.3, -0.2, 0.5], "acos_asin_boundary"),
    "asin": (lambda h: torch.asin(h), [1.5, 0.3, -0.2, 0.5], "acos_asin_boundary"),
    "div": (lambda h: torch.div(torch.ones_like(h), h), [0.0, 1.0, 2.0, 0.5], "division_by_zero"),
    "reciprocal": (lambda h: torch.reciprocal(h), [0.0, 1.0, 2.0, 0.5], "division_by_zero"),
    "exp": (lambda h: torch.exp(h), [100.0, 1.0, 2.0, 0.5], "exp_overflow"),
    # in-place variants answer to their op's rules, with the input as the op read it
    "log_": (lambda h: h.clone().log_(), [0.0, 1.0, 2.0, 3.0], "log_of_zero"),
    "pow_": (lambda h: h.clone().pow_(0.5), [0.0, 1.0, 2.0, 0.5], "pow_at_zero"),  # its backward: PowBackward0
    "div_": (lambda h: torch.ones_like(h).div_(h), [0.0, 1.0, 2.0, 0.5], "division_by_zero"),
}


class EdgeModel(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x, keep):
        h = x * self.scale
        y = EDGES[self.name][0](h)  # the op runs on its table row's line
        return (y * keep).sum()


def _factory(name):
    def make():
        return EdgeModel(name)
    make.__name__ = f"edge_{name}"
    return make


def _batch(name):
    def batch():
        x = torch.tensor(EDGES[name][1])
        keep = torch.ones_like(x)
        keep[0] = 0.0  # the term at the edge is masked out: its value must not matter
        return {"x": (x, keep)}
    return batch


CASES = {}
for _n in EDGES:
    globals()[f"edge_{_n}"] = _factory(_n)
    CASES[_n] = Case(_n, __name__, f"edge_{_n}", _batch(_n), expect={"cause": EDGES[_n][2]})
