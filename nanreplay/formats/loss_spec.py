"""A loss described as data (`F.cross_entropy` with its keyword arguments, `nn.MSELoss(...)`), and back.

Only torch's own loss functions and loss classes are rebuilt from a snapshot; a loss that
is user code is recorded as `module:name` and runs only with `--trust`. The step program
carries the loss's ops anyway: a spec matters only for eager replays (`--model`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay.errors import ModelError, TrustError
from nanreplay.formats.usercode import resolve_callable

# torch.nn.functional losses a snapshot may name (the rest of F is not a loss).
FUNCTIONAL_LOSSES = frozenset({
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "cosine_embedding_loss", "cross_entropy",
    "ctc_loss", "gaussian_nll_loss", "hinge_embedding_loss", "huber_loss", "kl_div", "l1_loss", "margin_ranking_loss",
    "mse_loss", "multi_margin_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss", "nll_loss",
    "poisson_nll_loss", "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss",
    "triplet_margin_with_distance_loss"})


def loss_spec(loss_fn: Callable | None) -> dict:
    """Describe a loss as data where possible; an arbitrary callable becomes a code reference."""
    if loss_fn is None:
        return {"kind": "output"}  # the model's output is the loss
    if isinstance(loss_fn, nn.Module) and type(loss_fn).__module__.startswith("torch.nn"):
        cls = type(loss_fn)
        kwargs = {}
        for name in inspect.signature(cls.__init__).parameters:
            if name in ("self", "size_average", "reduce") or not hasattr(loss_fn, name):
                continue
            v = getattr(loss_fn, name)
            if v is None or isinstance(v, (bool, int, float, str, torch.Tensor)):
                kwargs[name] = v
        return {"kind": "module", "class": cls.__name__, "kwargs": kwargs}
    func, kwargs = loss_fn, {}
    if hasattr(loss_fn, "func") and hasattr(loss_fn, "keywords") and not getattr(loss_fn, "args", ()):
        func, kwargs = loss_fn.func, dict(loss_fn.keywords)  # functools.partial(F.cross_entropy, ...)
    name = getattr(func, "__name__", None)
    if name in FUNCTIONAL_LOSSES and getattr(F, name, None) is func and \
            all(v is None or isinstance(v, (bool, int, float, str, torch.Tensor)) for v in kwargs.values()):
        return {"kind": "functional", "name": name, "kwargs": kwargs}
    mod, qual = getattr(loss_fn, "__module__", None), getattr(loss_fn, "__qualname__", None)
    if mod and qual and "<" not in qual:
        return {"kind": "callable", "spec": f"{mod}:{qual}"}
    return {"kind": "unknown", "repr": repr(loss_fn)[:200]}


def loss_from_spec(spec: dict, *, trust: bool) -> tuple[Callable | None, str | None]:
    """(loss callable or None for 'the output is the loss', a readable name)."""
    kind = spec.get("kind")
    kw = spec.get("kwargs") or {}
    if kind == "output":
        return None, None
    if kind == "functional":
        name = spec.get("name")
        if name not in FUNCTIONAL_LOSSES or not callable(getattr(F, name, None)):
            raise ModelError(f"the snapshot's loss F.{str(name)[:60]} is not a torch loss function; pass --loss")
        fn = getattr(F, name)
        label = f"F.{name}" + (f"({', '.join(f'{k}={v!r}' for k, v in kw.items() if not isinstance(v, torch.Tensor))})"
                               if kw else "")
        return (lambda out, tgt: fn(out, tgt, **kw)), label
    if kind == "module":
        name = spec.get("class")
        cls = getattr(nn, name, None) if isinstance(name, str) and name.endswith("Loss") else None
        if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
            raise ModelError(f"the snapshot's loss nn.{str(name)[:60]} is not a torch loss class; pass --loss")
        try:
            module = cls(**kw)
        except Exception as e:  # noqa: BLE001 - bad keyword arguments from the file
            raise ModelError(f"the snapshot's loss nn.{name} cannot be built from its arguments: {e}; pass --loss") \
                from None
        shown = ", ".join(f"{k}={v!r}" for k, v in kw.items() if not isinstance(v, torch.Tensor))
        return module, f"nn.{name}({shown})"
    if kind == "callable":
        if not trust:
            raise TrustError(f"the snapshot's loss is code ({spec.get('spec')}); it runs only with --trust, "
                             "or name a loss yourself with --loss")
        return resolve_callable(spec["spec"], "snapshot loss"), spec["spec"]
    raise ModelError(f"the snapshot's loss ({str(spec.get('repr', kind))[:80]}) cannot be rebuilt; pass --loss")


def loss_label(spec: dict) -> str | None:
    k = spec.get("kind")
    return {"functional": f"F.{spec.get('name')}", "module": f"nn.{spec.get('class')}",
            "callable": spec.get("spec"), "step_fn": spec.get("spec")}.get(k)
