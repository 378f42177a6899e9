"""The culprit inside an optimizer update, as rules see it: a `Site` plus the update it ran in.

`UpdateSite.us` is the recorded update (`replay.update.UpdateSubject`: class, hyperparameters,
weights, gradients and state before the step), `UpdateSite.upd` what the replay did (weights and
state after it). The helpers answer the questions the optimizer rules ask: which entries broke,
what the gradient and the state held there, what the learning rate was, what a dtype makes of eps.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from nanreplay import stats
from nanreplay.diagnose.site import Site
from nanreplay.enums import Phase
from nanreplay.replay.update import optimizer_class

# the state entry under the square root (or the max) of the update's denominator, per optimizer
_DENOMINATOR = {"Adam": "exp_avg_sq", "AdamW": "exp_avg_sq", "NAdam": "exp_avg_sq", "RAdam": "exp_avg_sq",
                "Adamax": "exp_inf", "RMSprop": "square_avg", "Adagrad": "sum", "Adadelta": "square_avg"}


def denominator_key(cls: str, hyper: dict) -> str | None:
    if cls in ("Adam", "AdamW") and hyper.get("amsgrad"):
        return "max_exp_avg_sq"
    return _DENOMINATOR.get(cls)


def is_update_site(s: Site) -> bool:
    return isinstance(s, UpdateSite) and s.event.phase == Phase.OPTIMIZER


def g(x: float) -> str:
    """A number as sentences show it."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.3g}"


@dataclass
class UpdateSite(Site):
    us: Any = None  # replay.update.UpdateSubject
    upd: Any = None  # replay.update.UpdateReplay

    @property
    def param(self) -> str:
        """The parameter the failure is (the first non-finite one after the update)."""
        return self.step.failure.name if self.step.failure is not None else self.us.names[0]

    @property
    def hyper(self) -> dict:
        return self.us.group_of(self.param)

    @property
    def pdtype(self) -> torch.dtype:
        return self.us.dtype_of(self.param)

    @property
    def pdtype_name(self) -> str:
        return stats.dtype_name(self.pdtype)

    @cached_property
    def bad(self) -> torch.Tensor:
        """Entries of the failing parameter that are NaN/Inf after the replayed update."""
        return self.upd.nonfinite(self.param)

    @cached_property
    def broken(self) -> list[tuple[str, int, int]]:
        """(parameter, NaN/Inf entries, numel) for every parameter the replayed update broke."""
        out = []
        for n, a in self.upd.after.items():
            k = int((~torch.isfinite(a)).sum())
            if k:
                out.append((n, k, a.numel()))
        return out

    def broken_sentence(self) -> str:
        parts = [f"{n} ({k} of {t} entries)" for n, k, t in self.broken[:6]]
        more = f" and {len(self.broken) - 6} more" if len(self.broken) > 6 else ""
        return ", ".join(parts) + more

    def at_bad(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.shape != self.bad.shape:
            return None
        return t[self.bad]

    def grad_at_bad(self) -> torch.Tensor | None:
        return self.at_bad(self.us.grads.get(self.param))

    def state_after(self, key: str) -> torch.Tensor | None:
        return self.upd.state_after.get(self.param, {}).get(key)

    def state_before(self, name: str | None = None) -> dict:
        return self.us.state.get(name or self.param) or {}

    def lr(self, hyper: dict | None = None) -> float | None:
        v = (hyper or self.hyper).get("lr")
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def nonfinite_state(self) -> list[tuple[str, str, int, int]]:
        """(parameter, state key, NaN entries, Inf entries) of the state before the step that is already non-finite."""
        out = []
        for n, st in self.us.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    nan, inf = stats.leaf_counts(v)
                    if nan or inf:
                        out.append((n, k, nan, inf))
                elif isinstance(v, float) and not math.isfinite(v):
                    out.append((n, k, int(math.isnan(v)), int(math.isinf(v))))
        return out

    def nonfinite_lrs(self) -> list[tuple[int, float]]:
        return [(i, float(h["hyper"]["lr"])) for i, h in enumerate(self.us.groups)
                if isinstance(h["hyper"].get("lr"), (int, float)) and not math.isfinite(float(h["hyper"]["lr"]))]

    def last_finite_lr(self) -> tuple[float, str] | None:
        """The learning rate to go back to: the last finite one the guard logged, or the scheduler's base."""
        for row in reversed(self.us.history):
            lr = row.get("lr")
            if isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0:
                return float(lr), f"the last finite learning rate, logged at step {row.get('step')}"
        sched = self.us.scheduler or {}
        for lr in sched.get("base_lrs") or []:
            if math.isfinite(lr) and lr > 0:
                return float(lr), f"{sched.get('class', 'the scheduler')}'s base learning rate"
        for grp in self.us.groups:
            lr = grp["hyper"].get("initial_lr")
            if isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0:
                return float(lr), "the learning rate the scheduler started from (initial_lr)"
        return None

    def optimizer_call(self, **changed: Any) -> str:
        """`torch.optim.Adam(model.parameters(), lr=..., eps=...)`: the learning rate, the hyperparameters that differ
        from the class's defaults, and the changed ones."""
        defaults = _defaults(self.us.cls)

        def shown(k: str, v: Any) -> bool:
            if k == "lr":
                return True
            return not _same(v, defaults[k]) if k in defaults else v not in (0, None, False)
        keep = {k: self.hyper[k] for k in ("lr", "momentum", "betas", "eps", "weight_decay", "nesterov", "amsgrad")
                if k in self.hyper and k not in changed and shown(k, self.hyper[k])}
        keep.update(changed)
        args = ", ".join(f"{k}={tuple(v) if isinstance(v, list) else _lit(v)}" for k, v in keep.items())
        return f"optimizer = torch.optim.{self.us.cls}(model.parameters(), {args})"


def _defaults(cls: str) -> dict:
    """The constructor defaults of a torch.optim class (allowlisted name), e.g. Adam's eps=1e-08."""
    try:
        fn = optimizer_class(cls).__init__
        return {k: p.default for k, p in inspect.signature(fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    except Exception:  # noqa: BLE001 - without the defaults every hyperparameter is shown
        return {}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _lit(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else repr(v)
