"""How to build the model again, for the rare step that cannot travel as a program (analyzed with --trust).

A factory that needs arguments nobody saved is no recipe: `Wav2Vec2ForCTC` alone cannot be built. So the
snapshot names the class *and* the constructor arguments, as data:

* a Hugging Face model (`cls(config)`): its config as JSON, with the config's class (`from_dict` rebuilds it);
* any other class: every constructor parameter the model keeps under the same name as plain data
  (`self.d_model = d_model`), any config-like object among them (a `to_dict()` whose class has `from_dict`)
  as above;
* a required parameter that cannot be found that way: no factory at all, and the reason says to pass
  `NanGuard(factory="pkg.mod:build")`, a zero-argument function that builds the model.

`arguments` is strict JSON text: `{name: value}`, a config as `{"config_class": "mod:Class", "values": {...}}`;
a non-finite float (Mamba2's `time_step_limit=(0.0, inf)`) is `{"f": "inf"}`, as in step programs.
This module imports only torch.
"""

from __future__ import annotations

import inspect
import json
import math
from typing import Any

import torch.nn as nn

from nanreplay.capture import plain
from nanreplay.formats.program import encode_float

MAX_ARGUMENTS = 1 << 20  # characters of JSON


def _config(v: Any) -> dict | None:
    """A config object (a Hugging Face PretrainedConfig, or anything shaped like one) as data, else None."""
    cls = type(v)
    to_dict, from_dict = getattr(v, "to_dict", None), getattr(cls, "from_dict", None)
    if not (callable(to_dict) and callable(from_dict)) or cls.__module__ in ("builtins", "__main__"):
        return None
    try:
        values = _finite(plain.data(to_dict(), unknown=plain.refuse))
        json.dumps(values, allow_nan=False)
    except (plain.NotData, TypeError, ValueError):
        return None
    return {"config_class": f"{cls.__module__}:{cls.__qualname__}", "values": values}


def recipe(model: nn.Module, factory: str | None) -> tuple[str | None, str | None, str]:
    """(factory spec, constructor arguments as JSON or None, where they come from)."""
    if factory:
        return factory, None, "given"
    cls = type(model)
    if cls.__module__ in ("__main__", "builtins") or "<" in cls.__qualname__:
        return None, None, f"{cls.__qualname__} is defined in a script, not importable: pass NanGuard(factory=...)"
    spec = f"{cls.__module__}:{cls.__qualname__}"
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    args: dict[str, Any] = {}
    missing = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = _argument(model, p.name)
        if value is not None:
            args[p.name] = value
        elif p.default is p.empty:
            missing.append(p.name)
    if missing:
        return None, None, (f"{cls.__qualname__}({', '.join(missing)}) needs arguments the model does not keep: "
                            "pass NanGuard(factory='pkg.mod:build'), a function that builds it with no arguments")
    if not args:
        return spec, None, "derived from the model's class"
    text = json.dumps(args, allow_nan=False)
    if len(text) > MAX_ARGUMENTS:
        return None, None, f"{cls.__qualname__}'s constructor arguments are too large to record"
    return spec, text, "derived from the model's class and the constructor arguments it keeps"


def _argument(model: nn.Module, name: str) -> Any:
    """The constructor argument `name` as the model keeps it, as data; None where it keeps none."""
    if not hasattr(model, name) or isinstance(getattr(type(model), name, None), property):
        return None
    v = getattr(model, name)
    if isinstance(v, nn.Module) or callable(v):
        return None
    cfg = _config(v)
    if cfg is not None:
        return cfg
    try:
        v = _finite(plain.data(v, unknown=plain.refuse))
        json.dumps(v, allow_nan=False)
    except (plain.NotData, TypeError, ValueError):
        return None
    return v


def _finite(v: Any) -> Any:
    """Plain data with every non-finite float as {"f": "inf" | "-inf" | "nan"} (strict JSON holds none)."""
    if isinstance(v, float) and not math.isfinite(v):
        return encode_float(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v
