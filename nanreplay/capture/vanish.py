"""Vanishing gradients: a module whose gradient norm collapses relative to the rest of the model (docs/flow.md).

The guard's one fused norm per step gives every parameter's gradient norm (capture/flow.py). On every eighth step
(`EVERY`) they are summed per module (the module that owns the parameter) and each module's *share* of the total
norm (squared) goes into a ring of the last `window` samples, on the gradients' device. A module vanishes when its
share falls `factor` times (1e4 by default) below its own median share over that window, on `patience` samples in
a row, with a non-zero norm (an exact zero is the dead-gradient trigger's). Shares, not norms: a loss that goes to
zero (a fit, a converged run, a batch with small advantages) shrinks every module's norm together and leaves the
shares alone; a saturated or dead stretch of layers shrinks the norms of the modules behind it and not the others'.

Cost on a sampled step: eight small tensor ops on the per-parameter norms and one more number in the guard's one
host sync (the count of collapsed modules); none on the other steps. The median is refreshed every second sample.
This module imports only torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

FACTOR = 1e4  # a module's share of the norm falling this many times below its median share
WINDOW = 32  # samples of history the median is taken over
WARM = 4  # samples before anything can fire
EVERY = 8  # steps between samples (a vanished gradient stays vanished: a sample every eighth step sees it)


class VanishWatch:
    """Each module's share of the gradient norm over the last `window` samples, and the modules whose share
    collapsed. Shares are kept squared (norm^2 / total^2), 0 for a step without a gradient (left out of the median)."""

    def __init__(self, factor: float = FACTOR, window: int = WINDOW, patience: int = 3):
        self.factor2 = float(factor) ** 2
        self.window, self.patience = max(WARM, int(window)), max(1, int(patience))
        self.modules: list[str] = []  # column -> module name
        self._col: dict[str, int] = {}
        self._key: tuple = ()
        self._index: torch.Tensor | None = None  # this parameter set's column per parameter
        self._ring: torch.Tensor | None = None  # [window, modules] squared shares
        self._limit: torch.Tensor | None = None  # median squared share / factor^2 per module (0: cannot fire)
        self._steps = self._rows = self._run = 0
        self._sq: torch.Tensor | None = None  # the last sample's squared module norms (read only when firing)
        self._hit: torch.Tensor | None = None
        self.fired: set[str] = set()
        self.pending: list[dict] | None = None

    def observe(self, params: list[torch.Tensor], norms: torch.Tensor, total: torch.Tensor,
                names: Callable[[], dict[int, str]]) -> torch.Tensor | None:
        """On a sampled step, its count of collapsed modules (a 0-d tensor for the guard's one host sync); None on
        the other steps and while the window fills. `names()`: parameter id -> its name (asked when the set of
        gradients changes)."""
        self._steps += 1
        if self._steps % EVERY:
            return None
        key = tuple(map(id, params))
        if key != self._key:
            self._columns(params, key, names(), norms.device)
        sq = torch.zeros(len(self.modules), device=norms.device).index_add_(0, self._index, norms * norms)
        share = sq / (total * total)
        self._ring[self._rows % self.window].copy_(share)
        self._rows += 1
        if self._rows < WARM:
            return None
        if self._limit is None or self._rows % 2 == 0:
            ring = self._ring[:min(self._rows, self.window)]
            med = torch.nanmedian(ring.masked_fill(ring <= 0, float("nan")), dim=0).values
            self._limit = torch.nan_to_num(med, nan=0.0) / self.factor2
        self._sq, self._hit = sq, share < self._limit  # (an exact zero counts here; seen() leaves it out)
        return self._hit.sum(dtype=torch.float32)

    def seen(self, count: int, total: float) -> None:
        """The host's half, with the count read back: fire (`pending`) after `patience` samples in a row."""
        if count <= 0:
            self._run = 0
            return
        self._run += 1
        if self._run < self.patience or self._hit is None:
            return
        out = []
        hits = [(c, sq, limit) for c, (hit, sq, limit) in enumerate(zip(self._hit.tolist(), self._sq.tolist(),
                                                                          self._limit.tolist(), strict=True))
                if hit and sq > 0]  # an exact zero is the dead-gradient trigger's
        if not hits:
            self._run = 0
            return
        for c, sq, limit in hits:
            name = self.modules[c]
            if name in self.fired:
                continue
            self.fired.add(name)
            out.append({"module": name, "norm": math.sqrt(sq), "share": math.sqrt(sq) / total if total else None,
                        "median_share": math.sqrt(limit * self.factor2), "steps": self._run * EVERY,
                        "total_norm": total})
        if out:
            self.pending = out

    def _columns(self, params: list[torch.Tensor], key: tuple, names: dict[int, str], device) -> None:
        cols = []
        for p in params:
            name = names.get(id(p), "")
            mod = name.rsplit(".", 1)[0] if "." in name else ""
            if mod not in self._col:
                self._col[mod] = len(self.modules)
                self.modules.append(mod)
            cols.append(self._col[mod])
        m = len(self.modules)
        if self._ring is None or self._ring.shape[1] < m:
            ring = torch.zeros((self.window, m), device=device)
            if self._ring is not None:
                ring[:, :self._ring.shape[1]] = self._ring
                if self._limit is not None:
                    self._limit = torch.cat([self._limit, torch.zeros(m - self._limit.numel(), device=device)])
            self._ring = ring
        self._index = torch.tensor(cols, device=device, dtype=torch.long)
        self._key = key
