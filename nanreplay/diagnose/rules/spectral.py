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
from nanreplay.diagnose.site import Site
from nanreplay.enums import FixKind

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
