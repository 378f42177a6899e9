"""Importing code the user named (`--model`, `--loss`, or a snapshot's factory with `--trust`).

Code runs here only where the user asked for it: `--model` / `--loss` name code
the user chose, and specs stored *inside* a snapshot run only with `--trust`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch.nn as nn
import torch.nn.functional as F

from nanreplay.errors import ModelError
from nanreplay.formats.program import parse_json
from nanreplay.inputs import code_spec


def resolve_callable(spec: str, what: str) -> Callable:
    """`pkg.mod:attr` -> the object, with one clear line for each way it can fail."""
    mod_name, attr = code_spec(spec, what)
    make_cwd_importable()
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and mod_name.split(".")[0] == e.name.split(".")[0] and mod_name.startswith(e.name):
            raise ModelError(f"{what} {spec!r}: cannot import module {e.name!r} "
                             "(is it installed, or on PYTHONPATH? run from the folder that holds it)") from None
        raise ModelError(f"{what} {spec!r}: importing {mod_name!r} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - user code; any error is one line
        raise ModelError(f"{what} {spec!r}: importing {mod_name!r} raised {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelError(f"{what} {spec!r}: module {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ModelError(f"{what} {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def make_cwd_importable() -> None:
    """Let `--model mymodel:build` find `mymodel.py` next to where the command runs — without shadowing.

    The folder goes at the *end* of sys.path: an installed package always wins over a
    file of the same name there (a `jinja2.py` planted next to a snapshot must not run
    when the report renders); only names nothing else provides resolve to it.
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def build_model(spec: str, arguments: str | None = None) -> nn.Module:
    """`factory()`, or `factory(**arguments)` with the constructor arguments a snapshot recorded (JSON text; a
    config as {"config_class": "mod:Class", "values": {...}}, rebuilt with the class's `from_dict`)."""
    factory = resolve_callable(spec, "--model")
    kwargs = _arguments(spec, arguments) if arguments else {}
    try:
        model = factory(**kwargs)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"--model {spec!r}: the factory raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"--model {spec!r}: the factory returned a {type(model).__name__}, not an nn.Module")
    return model


def _arguments(spec: str, text: str) -> dict:
    try:
        args = _floats(parse_json(text))
    except Exception as e:  # noqa: BLE001 - strict JSON or one line
        raise ModelError(f"{spec}: the snapshot's constructor arguments are not valid JSON ({e})") from None
    if not isinstance(args, dict):
        raise ModelError(f"{spec}: the snapshot's constructor arguments are not a mapping")
    out = {}
    for name, v in args.items():
        if isinstance(v, dict) and set(v) == {"config_class", "values"} and isinstance(v["config_class"], str):
            cls = resolve_callable(v["config_class"], "the snapshot's config class")
            from_dict = getattr(cls, "from_dict", None)
            try:
                v = from_dict(v["values"]) if callable(from_dict) else cls(**v["values"])
            except Exception as e:  # noqa: BLE001 - user code; one line
                raise ModelError(f"{spec}: rebuilding its {name} ({v['config_class']}) raised "
                                 f"{type(e).__name__}: {e}") from None
        out[str(name)] = v
    return out


_NONFINITE = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def _floats(v: Any) -> Any:
    """Recorded constructor arguments with {"f": "inf"} (capture/recipe.py's non-finite float) decoded."""
    if isinstance(v, dict):
        if set(v) == {"f"} and v["f"] in _NONFINITE:
            return _NONFINITE[v["f"]]
        return {k: _floats(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_floats(x) for x in v]
    return v


def resolve_loss(spec: str) -> Callable:
    """A torch.nn.functional name, a torch.nn loss class name, or MODULE:CALLABLE."""
    if ":" in spec:
        fn = resolve_callable(spec, "--loss")
    elif callable(getattr(F, spec, None)) and not spec.startswith("_"):
        return getattr(F, spec)
    elif inspect.isclass(getattr(nn, spec, None)) and issubclass(getattr(nn, spec), nn.Module):
        fn = getattr(nn, spec)
    else:
        raise ModelError(f"--loss {spec!r}: not a torch.nn.functional function (e.g. cross_entropy, mse_loss), "
                         "a torch.nn loss class (e.g. CrossEntropyLoss) or MODULE:CALLABLE")
    if inspect.isclass(fn) and issubclass(fn, nn.Module):
        try:
            fn = fn()
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"--loss {spec!r}: constructing {fn.__name__}() raised {type(e).__name__}: {e}") from None
    return fn


