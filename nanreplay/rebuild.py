"""From a snapshot back to something runnable: the model, the batch and the loss.

Code runs here only where the user asked for it: `--model` / `--loss` name code
the user chose, and specs stored *inside* a snapshot run only with `--trust`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay.errors import UsageError
from nanreplay.snapshot import Snapshot, iter_tensors, map_tensors

LOSS_MODULE = "<loss>"


@dataclass
class Subject:
    """Everything one replay needs; `forward()` and `loss()` are what the step runs."""

    model: nn.Module
    inputs: Any
    target: Any
    loss_fn: Callable | None
    loss_name: str | None
    how: str  # how the model was rebuilt, for the report
    device: torch.device
    autocast: dict | None = None  # {"device_type": ..., "dtype": ...} when the step ran under autocast
    names: dict[int, str] = field(default_factory=dict)  # id(module) -> qualified name
    # Restores RNG and any other global state the step depends on; called before every replay.
    prepare: Callable[[], None] = lambda: torch.manual_seed(0)
    input_label: str = "inputs"  # how the snapshot named the batch parts, for messages
    target_label: str = "target"
    site: Callable | None = None  # op attribution for programs without Python frames (exported)
    loss_scale: float | None = None  # a GradScaler's scale: backward ran on the scaled loss
    model_class: str | None = None  # the user's class name, where `model` is a stand-in (exported program)

    def __post_init__(self) -> None:
        self.names = {id(m): n for n, m in self.model.named_modules()}

    def forward(self) -> Any:
        return call_model(self.model, self.inputs)

    def converted(self, dtype: torch.dtype | None = None, autocast: dict | None | str = "same") -> Subject:
        """A copy of this step in another floating dtype and/or autocast setting; this one stays untouched."""
        model = copy.deepcopy(self.model)
        loss_fn = self.loss_fn
        conv = (lambda t: t.to(dtype) if t.is_floating_point() else t) if dtype is not None else (lambda t: t)
        if dtype is not None:
            model.to(dtype)
            if isinstance(loss_fn, nn.Module):  # e.g. CrossEntropyLoss(weight=...)
                loss_fn = copy.deepcopy(loss_fn).to(dtype)
        return dataclasses.replace(
            self, model=model, loss_fn=loss_fn, inputs=map_tensors(self.inputs, conv),
            target=map_tensors(self.target, conv), autocast=self.autocast if autocast == "same" else autocast,
            site=getattr(model, "site", None) if self.site is not None else None)

    def loss(self, output: Any) -> torch.Tensor:
        loss = compute_loss(output, self.target, self.loss_fn)
        return loss * self.loss_scale if self.loss_scale else loss


def call_model(model: Callable, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _prediction(output: Any) -> Any:
    """The tensor a loss function should see, from common model output shapes."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) or hasattr(output, "keys"):
        for k in ("logits", "output", "out", "pred", "prediction"):
            if k in output:
                return output[k]
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


def compute_loss(output: Any, target: Any, loss_fn: Callable | None) -> torch.Tensor:
    if loss_fn is None:
        loss = output
        if not isinstance(output, torch.Tensor):
            if (isinstance(output, dict) or hasattr(output, "keys")) and "loss" in output:
                loss = output["loss"]
            elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) \
                    and output[0].numel() == 1:
                loss = output[0]
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise UsageError(
                f"the model's output is {_describe(output)}, not a scalar loss, and no loss is known: "
                "pass --loss (e.g. --loss cross_entropy or --loss mypkg.losses:my_loss)"
            )
        return loss.reshape(())
    if target is None:
        raise UsageError("the loss needs a target, but the snapshot holds no target (y / targets / labels)")
    loss = loss_fn(_prediction(output), target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UsageError(f"the loss returned {_describe(loss)}, not a scalar (use a reduction such as 'mean')")
    return loss.reshape(())


# ---------------------------------------------------------------- code specs


def resolve_callable(spec: str, what: str) -> Callable:
    """`pkg.mod:attr` -> the object, with one clear line for each way it can fail."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise UsageError(f"{what} {spec!r}: expected MODULE:NAME, e.g. mypkg.models:build")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # like `python -m`: code next to where you run it is importable
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and mod_name.split(".")[0] == e.name.split(".")[0] and mod_name.startswith(e.name):
            raise UsageError(f"{what} {spec!r}: cannot import module {e.name!r} "
                             "(is it installed, or on PYTHONPATH? run from the folder that holds it)") from None
        raise UsageError(f"{what} {spec!r}: importing {mod_name!r} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - user code; any error is one line
        raise UsageError(f"{what} {spec!r}: importing {mod_name!r} raised {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{what} {spec!r}: module {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise UsageError(f"{what} {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def build_model(spec: str) -> nn.Module:
    factory = resolve_callable(spec, "--model")
    try:
        model = factory()
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"--model {spec!r}: the factory raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec!r}: the factory returned a {type(model).__name__}, not an nn.Module")
    return model


def resolve_loss(spec: str) -> Callable:
    """A torch.nn.functional name, a torch.nn loss class name, or MODULE:CALLABLE."""
    if ":" in spec:
        fn = resolve_callable(spec, "--loss")
    elif callable(getattr(F, spec, None)) and not spec.startswith("_"):
        return getattr(F, spec)
    elif inspect.isclass(getattr(nn, spec, None)) and issubclass(getattr(nn, spec), nn.Module):
        fn = getattr(nn, spec)
    else:
        raise UsageError(f"--loss {spec!r}: not a torch.nn.functional function (e.g. cross_entropy, mse_loss), "
                         "a torch.nn loss class (e.g. CrossEntropyLoss) or MODULE:CALLABLE")
    if inspect.isclass(fn) and issubclass(fn, nn.Module):
        try:
            fn = fn()
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"--loss {spec!r}: constructing {fn.__name__}() raised {type(e).__name__}: {e}") from None
    return fn


# ---------------------------------------------------------------- state


_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile


def _strip_prefixes(state: dict, own: dict) -> dict:
    for p in _PREFIXES:
        if state and not (state.keys() & own.keys()) and all(k.startswith(p) for k in state):
            state = {k[len(p):]: v for k, v in state.items()}
    return state


def load_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a snapshot's state dict, naming exactly what does not fit.

    Floating tensors keep the snapshot's dtype (a model trained in fp16 must
    replay in fp16, whatever dtype the factory builds it in).
    """
    own = model.state_dict()
    state = _strip_prefixes(state, own)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} (snapshot {list(state[k].shape)}, model {list(own[k].shape)})"
              for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = []
        for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", shapes)):
            if keys:
                more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
                parts.append(f"{label}: {', '.join(keys[:5])}{more}")
        raise UsageError("the snapshot's state dict does not fit the model: " + "; ".join(parts))
    with torch.no_grad():
        tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        for name, t in tensors:
            s = state.get(name)
            if s is not None and s.is_floating_point() and t.is_floating_point() and s.dtype != t.dtype:
                t.data = t.data.to(s.dtype)
    model.load_state_dict(state)


def to_device(obj: Any, device: torch.device) -> Any:
    return map_tensors(obj, lambda t: t.to(device))


def parse_device(spec: str | None) -> torch.device:
    try:
        dev = torch.device(spec or "cpu")
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--device {spec!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {spec!r}: CUDA is not available on this machine (use --device cpu)")
    return dev


def from_seed(snap: Snapshot, *, model: str | None, loss: str | None, device: str | None,
              trust: bool) -> Subject:
    """Rebuild a seed-format snapshot: the model comes from --model (or a trusted pickled module)."""
    dev = parse_device(device)
    if model is not None:
        m = build_model(model)
        how = f"--model {model}"
    elif snap.module is not None:  # only reachable with --trust: read_file refused otherwise
        m, how = snap.module, "pickled module in the snapshot (--trust)"
    else:
        raise UsageError(f"{snap.path}: a seed-format snapshot holds only weights; say which model they belong to "
                         "with --model MODULE:FACTORY (a zero-argument callable returning the nn.Module)")
    return eager_subject(snap, m, how, resolve_loss(loss) if loss else None, loss, dev,
                         input_label=snap.keys.get("inputs", "inputs"),
                         target_label=snap.keys.get("target", "target"))


def eager_subject(snap: Snapshot, model: nn.Module, how: str, loss_fn: Callable | None, loss_name: str | None,
                  device: torch.device, **extra: Any) -> Subject:
    """A Subject that runs `model`, with the snapshot's state loaded, on the snapshot's batch."""
    if snap.state is not None:
        load_state(model, snap.state)
    model.to(device)
    return Subject(model=model, inputs=to_device(snap.inputs, device), target=to_device(snap.target, device),
                   loss_fn=loss_fn, loss_name=loss_name, how=how, device=device, **extra)


def subject(snap: Snapshot, *, model: str | None, loss: str | None, device: str | None, trust: bool) -> Subject:
    """The runnable step for any snapshot format."""
    if snap.format == "native":
        from nanreplay import native

        return native.subject(snap, model=model, loss=loss, device=device, trust=trust)
    return from_seed(snap, model=model, loss=loss, device=device, trust=trust)


def batch_tensors(subject: Subject):
    """(name, role, tensor) for every tensor the batch holds."""
    yield from ((f"{subject.input_label}{n}", "input", t) for n, t in iter_tensors(subject.inputs))
    yield from ((f"{subject.target_label}{n}", "target", t) for n, t in iter_tensors(subject.target))
