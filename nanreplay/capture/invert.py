"""The weights and optimizer state *before* an update, recovered from what the update left behind.

When `optimizer.step()` turns weights non-finite, the post-step hook sees the weights after the
update. Where the update is invertible — SGD (momentum, Nesterov, dampening, weight decay) and
Adam/AdamW (amsgrad, weight decay, maximize) — the step it took can be computed from the
post-step optimizer state alone, because torch applies exactly that state:

    SGD, momentum:  p_new = p_old - lr * buf_new                         ->  p_old = p_new + lr * buf_new
    Adam:           p_new = p_old - lr/bc1 * m_new / (sqrt(v_new/bc2) + eps)  ->  p_old = p_new + that step
    AdamW:          the same, then divided by (1 - lr * weight_decay)

and the state before the step follows from the gradient (unchanged by `step()`):
m_old = (m_new - (1-b1) g) / b1, v_old = max(0, (v_new - (1-b2) g^2) / b2), step_old = step - 1
(an Adam state at step 1 was empty: the optimizer creates it). All of it is computed in float64
and rounded once to the tensor's dtype, so a recovered value is within a rounding step of the
real one.

What cannot be recovered: an entry whose new value is NaN/Inf (what the update wrote there
says nothing about what was there). Those entries are marked (`lost`) and replaced by a stated
stand-in: where the update itself was finite and the weight overflowed to ±Inf, ±the dtype's
largest value (the same update from there overflows again, so the replay shows the overflow);
everywhere else 0 (a non-finite update makes any start non-finite).

This module imports only torch: it runs inside the training process, and only when an update failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

INVERTIBLE = ("SGD", "Adam", "AdamW")

STAND_IN = ("entries whose value after the update is NaN/Inf cannot be recovered; they hold stand-ins: "
            "±(the dtype's largest value) where the update itself was finite and the weight overflowed, "
            "0 elsewhere")


@dataclass
class Recovered:
    """One parameter's pre-step weight and optimizer state, as recovered."""

    weight: torch.Tensor  # in the parameter's dtype
    state: dict | None  # None: the parameter had no optimizer state before the step
    lost: torch.Tensor  # bool: entries that hold a stand-in
    notes: list[str] = field(default_factory=list)


def _f(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _stand_in(p_new: torch.Tensor, cand: torch.Tensor, step_finite: torch.Tensor, dtype: torch.dtype):
    """(p_old with stand-ins, lost mask) from a candidate p_old computed in float64."""
    lost = ~torch.isfinite(p_new) | ~torch.isfinite(cand)
    if dtype.is_floating_point:
        fmax = torch.finfo(dtype).max
        cand = torch.where(lost, torch.zeros((), dtype=cand.dtype), cand)
        over = lost & torch.isinf(p_new) & step_finite
        cand = torch.where(over, torch.sign(p_new) * fmax, cand)
        cand = cand.clamp(-fmax, fmax)  # a recovered value rounds into range (it was a finite weight)
    return cand.to(dtype), lost


def recover(cls: str, group: dict, p_new: torch.Tensor, grad: torch.Tensor | None, state: dict) -> Recovered | None:
    """The pre-step weight and state of one parameter (CPU tensors in, CPU tensors out); None: not invertible."""
    if grad is None:  # the optimizer skipped this parameter: nothing changed
        return Recovered(p_new.clone(), {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
                         or None, torch.zeros(p_new.shape, dtype=torch.bool))
    if not p_new.is_floating_point() or p_new.is_complex() or grad.is_sparse:
        return None
    if cls == "SGD":
        return _sgd(group, p_new, grad, state)
    if cls in ("Adam", "AdamW"):
        return _adam(cls, group, p_new, grad, state)
    return None


def _sgd(group: dict, p_new: torch.Tensor, grad: torch.Tensor, state: dict) -> Recovered | None:
    lr, mom = _f(group["lr"]), _f(group.get("momentum", 0.0))
    damp, wd = _f(group.get("dampening", 0.0)), _f(group.get("weight_decay", 0.0))
    nesterov, maximize = bool(group.get("nesterov")), bool(group.get("maximize"))
    p = p_new.double()
    g = -grad.double() if maximize else grad.double()
    shrink = 1.0 - lr * wd
    buf = state.get("momentum_buffer")
    if shrink == 0.0 or not math.isfinite(shrink) or (mom != 0.0 and buf is None):
        return None
    if mom == 0.0:
        step = lr * g  # p_new = p_old * shrink - lr * g
        cand = (p + step) / shrink
        new_state = dict(state) or None
    else:
        b = buf.double()
        step = lr * (g + mom * b) if nesterov else lr * b
        cand = (p + step) / shrink if nesterov else p + step
        new_state = None
    w, lost = _stand_in(p_new, cand, torch.isfinite(step), p_new.dtype)
    if mom != 0.0:
        g_eff = g + wd * w.double() if wd else g
        # buf_new = mom * buf_old + (1 - damp) * g_eff. (At the first step buf_new = g_eff, and this buf_old
        # gives the same buf_new: mom * damp * g_eff / mom + (1 - damp) * g_eff.)
        new_state = {"momentum_buffer": ((b - (1.0 - damp) * g_eff) / mom).to(buf.dtype)}
    return Recovered(w, new_state, lost)


def _adam(cls: str, group: dict, p_new: torch.Tensor, grad: torch.Tensor, state: dict) -> Recovered | None:
    if not all(k in state for k in ("step", "exp_avg", "exp_avg_sq")):
        return None
    b1, b2 = (_f(b) for b in group["betas"])
    lr, eps, wd = _f(group["lr"]), _f(group["eps"]), _f(group.get("weight_decay", 0.0))
    amsgrad, maximize = bool(group.get("amsgrad")), bool(group.get("maximize"))
    decoupled = cls == "AdamW" or bool(group.get("decoupled_weight_decay"))
    s = _f(state["step"])
    if s < 1 or b1 == 0.0 or b2 == 0.0:
        return None
    m, v = state["exp_avg"].double(), state["exp_avg_sq"].double()
    vmax = state.get("max_exp_avg_sq")
    if amsgrad and vmax is None:
        return None
    bc1, bc2 = 1.0 - b1**s, 1.0 - b2**s
    vhat = vmax.double() if amsgrad else v
    # the denominator as torch computed it, rounded to the state's dtype: in float16 an eps of 1e-8 is 0
    denom = (vhat.sqrt() / math.sqrt(bc2) + eps).to(state["exp_avg_sq"].dtype).double()
    step = (lr / bc1) * m / denom
    cand = p_new.double() + step
    shrink = 1.0 - lr * wd
    if decoupled and wd:
        if shrink == 0.0 or not math.isfinite(shrink):
            return None
        cand = cand / shrink
    w, lost = _stand_in(p_new, cand, torch.isfinite(step), p_new.dtype)
    if s == 1:
        return Recovered(w, None, lost, ["the optimizer state was created by this step (step 1)"])
    g = -grad.double() if maximize else grad.double()
    if wd and not decoupled:
        g = g + wd * w.double()
    old = {"step": torch.tensor(s - 1.0, dtype=state["step"].dtype) if isinstance(state["step"], torch.Tensor)
           else s - 1.0,
           "exp_avg": ((m - (1.0 - b1) * g) / b1).to(state["exp_avg"].dtype),
           "exp_avg_sq": ((v - (1.0 - b2) * g * g) / b2).clamp_min(0.0).to(state["exp_avg_sq"].dtype)}
    if amsgrad:
        vm = vmax.double()
        old["max_exp_avg_sq"] = torch.where(vm > v, vm, old["exp_avg_sq"].double()).to(vmax.dtype)
    return Recovered(w, old, lost)
