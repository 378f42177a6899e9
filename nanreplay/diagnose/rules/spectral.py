"""The gradient of an eigendecomposition at a repeated eigenvalue (torch.linalg.eigh): its backward divides by
every gap λi - λj, and a gap of exactly 0 (a regular graph's Laplacian, a symmetric configuration, an identity
block) gives inf and 0 * inf = NaN.

No line change is exact here, because the quantity is not defined: the eigenvectors of a repeated eigenvalue are
any basis of its eigenspace, and a loss that reads one of them has no gradient. What is defined is a function of
the eigenspace (its projector V_k V_kᵀ, a sum over the whole repeated group) or of the eigenvalues alone. A tiny
perturbation that splits the eigenvalues (a diagonal ramp) keeps the step finite, but its gradient is then
1/ramp, large and arbitrary; so the rule advises and does not replay.
"""

from __future__ import annotations

import torch

from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site, packet
from nanreplay.enums import FixKind
from nanreplay.replay import frame_json

aten = torch.ops.aten


@rule("eigh_degenerate", aten._linalg_eigh, priority=187)
def _eigh_degenerate(s: Site) -> Diagnosis | None:
    if s.forward or s.event.phase != "backward":
        return None
    guidance = (f"the loss at {s.where} reads eigenvectors of an eigenvalue that is repeated in this batch: make it "
                "a function of the eigenspace (the projector V[:, k] V[:, k]ᵀ summed over the repeated group) or of "
                "the eigenvalues alone, or leave the degenerate matrices out of the batch")
    return Diagnosis(
        "eigh_degenerate", "eigh's gradient at a repeated eigenvalue",
        f"torch.linalg.eigh at {s.where} met a matrix with a repeated eigenvalue; its backward divides by the gap "
        f"between each pair of eigenvalues ({s.event.node or 'the eigh backward'}), 1/0 = inf there, and 0 * inf = NaN "
        "reached the gradients. The eigenvectors of a repeated eigenvalue are not unique (any rotation within the "
        "eigenspace is as valid), so a loss that reads them individually has no gradient at that point. A jitter "
        "added to the matrix keeps the step finite, but its gradient is then 1/jitter: large and arbitrary.",
        [Fix(FixKind.EIGENSPACE, "", guidance=guidance,
             reasoning="a function of the whole eigenspace, or of the eigenvalues, is differentiable where they repeat")])


def _slogdet_sign_behind(s: Site) -> int | None:
    """The forward index of the `_linalg_slogdet` whose sign selects the culprit's NaN constant: torch.logdet is
    `where(sign == -1, nan, logabsdet)` over slogdet, so the constant feeds a where whose condition (through at
    most a few elementwise ops) reads slogdet's sign."""
    for w in s.consumers():
        rec = s.step.ops[w]
        if packet(str(rec.op)) != "aten.where" or not rec.src:
            continue
        todo, seen = [rec.src[0]], 0
        while todo and seen < 6:
            i = todo.pop()
            seen += 1
            if i is None:
                continue
            r = s.step.ops[i]
            if packet(str(r.op)) == "aten._linalg_slogdet":
                return i
            todo.extend(r.src)
    return None


@rule("logdet_not_positive_definite", aten.scalar_tensor, priority=186)
def _logdet_indefinite(s: Site) -> Diagnosis | None:
    """torch.logdet of a matrix with a negative determinant: NaN by definition (a covariance that is not
    positive definite has no Gaussian). No line change is exact: the matrix has to be built positive definite
    (a Cholesky factor with a positive diagonal, L Lᵀ), which changes every value, so the rule advises."""
    if not s.forward:
        return None
    sl = _slogdet_sign_behind(s)
    if sl is None:
        return None
    matrix = s.origin(0, s.step.ops[sl])  # the op that made the matrix (through views and copies)
    src = frame_json(matrix.frame) if matrix is not None else None
    at = f"{src['file']}:{src['line']}" if src else s.where
    guidance = (f"build the matrix that torch.logdet reads at {s.where} positive definite by construction: predict a "
                "lower-triangular factor L with a positive diagonal (softplus or exp of the diagonal entries) and use "
                "L @ L.mT, or torch.distributions.MultivariateNormal(mu, scale_tril=L) and its log_prob; a 2×2 "
                "covariance can use its correlation instead: rho = tanh(c), off-diagonal rho * sx * sy")
    return Diagnosis(
        "logdet_not_positive_definite", "logdet of a matrix that is not positive definite",
        f"torch.logdet at {s.where} met a matrix whose determinant is negative: logdet is "
        "where(sign == -1, nan, log|det|) over slogdet, so the NaN is torch's own answer — the log of a negative "
        f"determinant is not defined. The matrix (made for slogdet at {at}) is not positive definite, so as a "
        "covariance it describes no Gaussian. torch.linalg.slogdet's logabsdet would be finite but wrong (the "
        "likelihood of an indefinite 'covariance' is unbounded below, and training pushes into it); a clamp of an "
        "entry or a jitter on the diagonal only moves the boundary. The remedy is the parameterisation.",
        [Fix(FixKind.POSITIVE_DEFINITE, "", guidance=guidance,
             reasoning="a matrix built as L Lᵀ with a positive diagonal is positive definite for every value the "
                       "model can predict")])
