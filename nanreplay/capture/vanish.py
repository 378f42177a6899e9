"""Vanishing gradients: a module whose gradient norm collapses relative to the rest of the model (docs/flow.md).

The guard's one fused norm per step gives every parameter's gradient norm, read back with the total in the guard's
one host sync (capture/flow.py). On every eighth step (`EVERY`) they are summed per module (the module that owns
the parameter) and each module's *share* of the total norm (squared) goes into a ring of the last `window`
samples. A module vanishes when its share falls `factor` times (1e4 by default) below its own median share over
that window, on `patience` samples in a row, with a non-zero norm (an exact zero is the dead-gradient trigger's).
Shares, not norms: a loss that goes to zero (a fit, a converged run, a batch with small advantages) shrinks every
module's norm together and leaves the shares alone; a saturated or dead stretch of layers shrinks the norms of the
modules behind it and not the others'.

A gradient vanishing from the first step (a deep sigmoid MLP at its default init) never had a larger share to fall
from, so the median rule cannot see it. For that, an absolute floor at the model's input end: when each of the first
`FRONT` modules with a gradient (registration order) carries less than `FLOOR` (1e-7) of the total norm on each of
the first `FLOOR_STEPS` steps, they fire, with every other module that stayed below the floor too. One module alone
is not enough: single healthy modules sit far lower at init (a key projection under near-uniform attention, 7e-13; a
router, 1e-11); the zoo's input ends start at 3e-4 and above, a 12-layer sigmoid MLP's at 3e-8 to 1e-17
(docs/flow.md, "Measured").

Cost: no tensor op at all. A sampled step does its arithmetic on the host, in Python floats, over the norms the
guard read back anyway (a few microseconds on a small model; a per-module sort of `window` numbers when the median
is refreshed, every second sample); the other steps only count. This module imports only torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

FACTOR = 1e4  # a module's share of the norm falling this many times below its median share
WINDOW = 32  # samples of history the median is taken over
WARM = 4  # samples before anything can fire
EVERY = 8  # steps between samples (a vanished gradient stays vanished: a sample every eighth step sees it)
FLOOR = 1e-7  # the input end's share of the norm below this on each of the first FLOOR_STEPS steps: vanishing from
FLOOR_STEPS = 3  # the start
FRONT = 3  # the input end: the first modules with a gradient, in registration order


class VanishWatch:
    """Each module's share of the gradient norm over the last `window` samples, and the modules whose share
    collapsed. Shares are kept squared (norm^2 / total^2); a share that is 0 or not a number (a step without a
    gradient, a non-finite total) is left out of the median."""

    def __init__(self, factor: float = FACTOR, window: int = WINDOW, patience: int = 3,
                 floor: float | None = FLOOR):
        self.factor2 = float(factor) ** 2
        self.floor2 = float(floor) ** 2 if floor else 0.0  # 0: no floor
        self._low: dict[int, list[float]] = {}  # column -> its shares while it stayed below the floor from the start
        self._front: list[int] = []  # the input end's columns
        self.window, self.patience = max(WARM, int(window)), max(1, int(patience))
        self.modules: list[str] = []  # column -> module name
        self._col: dict[str, int] = {}
        self._key: tuple = ()
        self._index: list[int] = []  # this parameter set's column per parameter
        self._ring: list[list[float]] = []  # up to `window` rows of squared shares per module
        self._limit: list[float] | None = None  # median squared share / factor^2 per module (0: cannot fire)
        self._steps = self._rows = self._run = 0
        self._sq: list[float] = []  # the last sample's squared module norms
        self._share: list[float] = []  # ... and squared shares
        self._hit: list[bool] = []
        self.fired: set[str] = set()
        self.pending: list[dict] | None = None

    def observe(self, params: list[torch.Tensor], norms: list[float], total: float,
                names: Callable[[], dict[int, str]]) -> int | None:
        """On a sampled step, its count of collapsed modules; None on the other steps and while the window fills.
        `norms`: each parameter's gradient norm, `total` the step's; `names()`: parameter id -> its name (asked
        when the set of gradients changes)."""
        self._steps += 1
        if self._steps <= FLOOR_STEPS and self.floor2:
            self._below_floor(params, norms, total, names)
        if self._steps % EVERY:
            return None
        key = tuple(map(id, params))
        if key != self._key:
            self._columns(params, key, names())
        sq = [0.0] * len(self.modules)
        for c, n in zip(self._index, norms, strict=True):
            sq[c] += n * n
        t2 = total * total
        share = [s / t2 if t2 > 0 else math.nan for s in sq]  # (0/0 and inf/inf: left out, as a non-number)
        if len(self._ring) < self.window:
            self._ring.append(share)
        else:
            self._ring[self._rows % self.window] = share
        self._rows += 1
        if self._rows < WARM:
            return None
        if self._limit is None or self._rows % 2 == 0:
            self._limit = [_lower_median(col) / self.factor2 for col in zip(*self._ring, strict=True)]
        self._sq, self._share = sq, share
        self._hit = [s < lim for s, lim in zip(share, self._limit, strict=True)]  # (an exact zero counts here)
        return sum(self._hit)

    def closest(self) -> float | None:
        """The last sample's lowest share / median share (unsquared) over the modules that could fire and had a
        gradient: how near a healthy run came to the threshold (benchmarks/flow_false_alarms.py)."""
        if not self._limit or not self._share:
            return None
        ratios = [math.sqrt(s / (lim * self.factor2)) for s, q, lim in zip(self._share, self._sq, self._limit,
                                                                             strict=False)
                  if lim > 0 and q > 0 and s == s]
        return min(ratios) if ratios else None

    def seen(self, count: int, total: float) -> None:
        """The host's half, with the count: fire (`pending`) after `patience` samples in a row."""
        if count <= 0:
            self._run = 0
            return
        self._run += 1
        if self._run < self.patience or not self._hit:
            return
        out = []
        hits = [(c, sq, limit) for c, (hit, sq, limit) in enumerate(zip(self._hit, self._sq, self._limit,
                                                                          strict=True))
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

    def _below_floor(self, params: list[torch.Tensor], norms: list[float], total: float,
                     names: Callable[[], dict[int, str]]) -> None:
        """One of the first FLOOR_STEPS steps: the modules whose share stayed below the floor on every one so far
        (a zero norm ends a module's run; a non-finite total ends the test). On the last, when the input end (the
        first FRONT modules with a gradient, in registration order) stayed below, those modules are `pending`."""
        t2 = total * total
        if not (0 < t2 < math.inf):
            self.floor2 = 0.0  # (a step with no usable total: no verdict from the start)
            return
        key = tuple(map(id, params))
        if key != self._key:
            self._columns(params, key, names())
        sq = [0.0] * len(self.modules)
        for c, n in zip(self._index, norms, strict=True):
            sq[c] += n * n
        if self._steps == 1:
            self._front = [c for c, s in enumerate(sq) if s > 0][:FRONT]
            if len(self._front) < FRONT:
                self.floor2 = 0.0  # (too few modules to have an input end)
                return
        low = {c: s / t2 for c, s in enumerate(sq) if 0 < s / t2 < self.floor2}
        if self._steps == 1:
            self._low = {c: [math.sqrt(v)] for c, v in low.items()}
        else:
            self._low = {c: [*was, math.sqrt(low[c])] for c, was in self._low.items() if c in low}
        if not all(c in self._low for c in self._front):
            self.floor2, self._low = 0.0, {}  # the input end learns: no vanishing from the start
            return
        if self._steps < FLOOR_STEPS:
            return
        out = []
        for c, shares in self._low.items():
            name = self.modules[c]
            if name in self.fired:
                continue
            self.fired.add(name)
            out.append({"module": name, "norm": math.sqrt(sq[c]), "share": max(shares), "median_share": None,
                        "steps": FLOOR_STEPS, "total_norm": total, "floor": math.sqrt(self.floor2),
                        "first_shares": shares})
        if out:
            self.pending = out
        self._low = {}

    def _columns(self, params: list[torch.Tensor], key: tuple, names: dict[int, str]) -> None:
        cols = []
        for p in params:
            name = names.get(id(p), "")
            mod = name.rsplit(".", 1)[0] if "." in name else ""
            if mod not in self._col:
                self._col[mod] = len(self.modules)
                self.modules.append(mod)
            cols.append(self._col[mod])
        m = len(self.modules)
        for row in self._ring:  # a module new to the run: no history (0, left out of its median)
            row.extend([0.0] * (m - len(row)))
        if self._limit is not None:
            self._limit.extend([0.0] * (m - len(self._limit)))
        self._index = cols
        self._key = key


def _lower_median(values: list[float]) -> float:
    """The lower median of the positive numbers in `values` (torch.nanmedian's choice for an even count); 0 when
    there are none."""
    vals = sorted(v for v in values if v > 0)  # (a NaN is not > 0)
    return vals[(len(vals) - 1) // 2] if vals else 0.0
