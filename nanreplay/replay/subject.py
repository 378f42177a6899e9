"""The runnable step every format rebuilds into: a `Subject` (model, batch, loss, how to run it)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from nanreplay.errors import UsageError
from nanreplay.pytree import iter_tensors, map_tensors

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
    site: Callable | None = None  # op attribution where the model has no Python frames (a step program)
    loss_scale: float | None = None  # a GradScaler's scale: backward ran on the scaled loss
    model_class: str | None = None  # the user's class name, where `model` is a stand-in (a step program)
    program: bool = False  # `model` runs a recorded step program (forward + loss, its casts explicit)
    memory_bound: int | None = None  # the replay's peak bytes, bounded before it runs (step programs)
    input_names: list[str] | None = None  # the forward's parameter names, for positional inputs
    constructions: list[dict] | None = None  # where the user's code built each nn.Sequential (capture/construct.py)
    step_fn: Callable | None = None  # the user's step_fn(model, batch) -> loss, for a step_fn snapshot with --model

    def __post_init__(self) -> None:
        self.names = {id(m): n for n, m in self.model.named_modules()}

    @property
    def run_autocast(self) -> dict | None:
        """The autocast to replay under: none for a step program, whose casts are already explicit ops."""
        return None if self.program else self.autocast

    def forward(self) -> Any:
        if self.program:
            return self.model(self.inputs, self.target)
        if self.step_fn is not None:
            return self.step_fn(self.model, self.inputs)
        return call_model(self.model, self.inputs)

    def step_dtype(self) -> torch.dtype:
        """The floating dtype most parameter elements have."""
        counts: dict[torch.dtype, int] = {}
        for p in self.model.parameters():
            if p.is_floating_point():
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        return max(counts, key=counts.get) if counts else torch.float32

    def converted(self, dtype: torch.dtype | None = None, autocast: dict | None | str = "same") -> Subject:
        """A copy of this step in another floating dtype and/or autocast setting that shares no tensor with
        this one: weights, buffers, constants, loss module and batch. A probe in float64 or a fix replay that
        writes in place can never change the step that was analyzed.

        A step program also learns the dtype: its own dtype becomes `dtype` everywhere, and the casts autocast
        inserted go to the new autocast's dtype (or to `dtype` when autocast is turned off)."""
        model = copy.deepcopy(self.model)
        _unshare(model, self.model)  # before any dtype change: .to() would write into a shared Parameter
        loss_fn = self.loss_fn
        if self.program:
            low = (self.autocast or {}).get("dtype")
            all_map = _with_complex({self.step_dtype(): dtype}) if dtype is not None else {}
            cast_map = {}
            if autocast != "same" and low is not None:
                cast_map = {low: autocast["dtype"] if autocast else (dtype or torch.float32)}
            model.set_policy(all_map, cast_map)
        if dtype is not None:
            src = self.step_dtype()
            mixed = {p.dtype for p in self.model.parameters() if p.is_floating_point()} - {src}
            if self.program and mixed:  # a body the code cast to half beside float32 layers: the program's own
                # casts map only the step's dtype (its .float() stays float32), so only those weights change
                model._apply(lambda t: t.to(dtype) if t.dtype == src else t)
            else:  # (not model.to(dtype): that casts a complex weight to a real dtype, dropping its imaginary part)
                cmap = _with_complex({src: dtype})
                model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t.to(cmap.get(t.dtype, t.dtype)))
            if isinstance(loss_fn, nn.Module):  # e.g. CrossEntropyLoss(weight=...)
                loss_fn = copy.deepcopy(loss_fn).to(dtype)

        def conv(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype, copy=True) if dtype is not None and t.is_floating_point() else t.clone()

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


def model_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returned itself: a scalar output; a `loss` key or attribute (a Hugging Face
    ModelOutput); the one scalar tensor among tuple outputs (nanoGPT's `logits, loss`)."""
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else None
    cand = None
    if isinstance(output, dict) or hasattr(output, "keys"):
        try:
            cand = output["loss"] if "loss" in output else None
        except (KeyError, TypeError):
            cand = None
    if cand is None and not isinstance(output, (tuple, list, dict)):
        cand = getattr(output, "loss", None)
    if isinstance(cand, torch.Tensor) and cand.numel() == 1:
        return cand
    if isinstance(output, (tuple, list)):
        scalars = [o for o in output if isinstance(o, torch.Tensor) and o.numel() == 1 and o.is_floating_point()]
        if len(scalars) == 1:
            return scalars[0]
    return None


def is_torch_loss(fn: Any) -> bool:
    """A loss function or class from torch itself (it wants one prediction tensor, not a model's tuple)."""
    fn = getattr(fn, "func", fn)  # functools.partial
    mod = type(fn).__module__ if isinstance(fn, nn.Module) else getattr(fn, "__module__", "") or ""
    return mod.startswith("torch.")


def compute_loss(output: Any, target: Any, loss_fn: Callable | None) -> torch.Tensor:
    """The step's loss from the model's output: its own loss when loss_fn is None; else loss_fn(output, target).

    A user's loss gets the output exactly as the model returned it (tuples, dicts, dataclasses); a torch
    loss gets the prediction tensor out of common output shapes.
    """
    if loss_fn is None:
        loss = model_loss(output)
        if loss is None:
            raise UsageError(
                f"the model's output is {_describe(output)}, not a scalar loss, and no loss is known: "
                "pass --loss (e.g. --loss cross_entropy or --loss mypkg.losses:my_loss)"
            )
        return loss if loss.dim() == 0 else loss.reshape(())
    torch_loss = is_torch_loss(loss_fn)
    if target is None and torch_loss:
        raise UsageError("the loss needs a target, but the snapshot holds no target (y / targets / labels)")
    pred = _prediction(output) if torch_loss else output
    loss = loss_fn(pred, target) if target is not None or _takes_target(loss_fn) else loss_fn(pred)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UsageError(f"the loss returned {_describe(loss)}, not a scalar (use a reduction such as 'mean')")
    return loss if loss.dim() == 0 else loss.reshape(())


def _takes_target(loss_fn: Callable) -> bool:
    """Whether a loss called with no target must still be given one (`None`): `def loss(out, y)` cannot be called
    as `loss(out)`, and the training loop called it `loss(out, None)`. A loss whose signature cannot be read, or that
    accepts one argument, is called with the output alone, as before."""
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return False
    try:
        sig.bind(object())
    except TypeError:
        try:
            sig.bind(object(), None)
        except TypeError:
            return False
        return True
    return False


def forward_parameter_names(model: nn.Module) -> list[str] | None:
    """The names of forward's positional parameters (`idx`, `targets`), to name batch tensors in reports."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names[:64] or None


def to_device(obj: Any, device: torch.device) -> Any:
    return map_tensors(obj, lambda t: t.to(device))


def batch_tensors(subject: Subject):
    """(name, role, tensor) for every tensor the batch holds. Positional inputs are named by the forward's
    own parameter names where the snapshot recorded them (`idx` rather than `inputs[0]`)."""
    names = subject.input_names or []
    for n, t in iter_tensors(subject.inputs):
        label = f"{subject.input_label}{n}"
        if names and not isinstance(subject.inputs, dict):
            if isinstance(subject.inputs, (tuple, list)):
                i = int(n[1:n.index("]")]) if n.startswith("[") else -1
                if 0 <= i < len(names):
                    label = f"{names[i]}{n[n.index(']') + 1:]}"
            elif n == "":
                label = names[0]
        yield label, "input", t
    yield from ((f"{subject.target_label}{n}", "target", t) for n, t in iter_tensors(subject.target))


def _unshare(copy: nn.Module, original: nn.Module) -> None:
    """Give `copy` its own parameters and buffers wherever it still holds the original's (a module whose
    deepcopy keeps tensors it was given)."""
    mine = {id(t) for t in original.parameters()} | {id(t) for t in original.buffers()}
    ptrs = {t.data_ptr() for t in list(original.parameters()) + list(original.buffers()) if t.numel()}
    for m in copy.modules():
        for k, p in list(m._parameters.items()):
            if p is not None and (id(p) in mine or (p.numel() and p.data_ptr() in ptrs)):
                m._parameters[k] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        for k, b in list(m._buffers.items()):
            if b is not None and (id(b) in mine or (b.numel() and b.data_ptr() in ptrs)):
                m._buffers[k] = b.detach().clone()


_COMPLEX = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}


def _with_complex(dtype_map: dict) -> dict:
    """A real dtype change and its complex counterpart (float32 -> float64: complex64 -> complex128), so that a
    complex weight, constant or cast of the step follows a float64 or half replay (bfloat16 has none: left)."""
    out = dict(dtype_map)
    for a, b in dtype_map.items():
        if a in _COMPLEX and b in _COMPLEX:
            out[_COMPLEX[a]] = _COMPLEX[b]
    return out
