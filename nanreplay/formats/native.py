"""The native snapshot format: writing it (capture side) and rebuilding from it (analysis side).

A native snapshot is one `torch.save` of a plain, versioned dict that loads with
`torch.load(weights_only=True)`:

    format, version, created, nanreplay_version, trigger, step, rank, world_size,
    loss_value, grad_norm, batch {inputs, target}, model_state, model_training,
    optimizer_state, model {exported, export_error, factory, factory_source, class},
    loss_spec, rng {cpu, cuda}, autocast, grad_scale, environment, history

The model (and loss) travel as a `torch.export` program (bytes in a uint8
tensor): data, not code, so analysis needs neither the training code nor
`--trust`. Where export failed, `model.factory` names code to rebuild it — that
runs only with `--trust` (or when the user names `--model` themselves).

This module imports only torch: training code pays for nothing else.
"""

from __future__ import annotations

import inspect
import io
import logging
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay.errors import ModelError, SnapshotError, TrustError, first_line
from nanreplay.formats import rebuild
from nanreplay.formats.base import Format, Snapshot
from nanreplay.formats.usercode import build_model, resolve_callable, resolve_loss
from nanreplay.replay.subject import Subject, call_model, compute_loss, to_device

# The native format. Bump VERSION on any incompatible change and say why here.
#   1 — first version.
FORMAT = "nanreplay.snapshot"
VERSION = 1

# ------------------------------------------------------------------ loss specs (data, not code)


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
            kwargs[name] = getattr(loss_fn, name)
        return {"kind": "module", "class": cls.__name__, "kwargs": kwargs}
    func, kwargs = loss_fn, {}
    if hasattr(loss_fn, "func") and hasattr(loss_fn, "keywords") and not getattr(loss_fn, "args", ()):
        func, kwargs = loss_fn.func, dict(loss_fn.keywords)  # functools.partial(F.cross_entropy, ...)
    name = getattr(func, "__name__", None)
    if name and getattr(F, name, None) is func:
        return {"kind": "functional", "name": name, "kwargs": kwargs}
    mod, qual = getattr(loss_fn, "__module__", None), getattr(loss_fn, "__qualname__", None)
    if mod and qual and "<" not in qual:
        return {"kind": "callable", "spec": f"{mod}:{qual}"}
    return {"kind": "unknown", "repr": repr(loss_fn)[:200]}


def loss_from_spec(spec: dict, *, trust: bool) -> tuple[Callable | None, str | None]:
    """(loss callable or None for 'the output is the loss', a readable name)."""
    kind = spec.get("kind")
    if kind == "output":
        return None, None
    if kind == "functional":
        fn = getattr(F, spec["name"], None)
        if fn is None:
            raise ModelError(f"the snapshot's loss F.{spec['name']} does not exist in this torch; pass --loss")
        kw = spec.get("kwargs") or {}
        label = f"F.{spec['name']}" + (f"({', '.join(f'{k}={v!r}' for k, v in kw.items())})" if kw else "")
        return (lambda out, tgt: fn(out, tgt, **kw)), label
    if kind == "module":
        cls = getattr(nn, spec["class"], None)
        if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
            raise ModelError(f"the snapshot's loss nn.{spec['class']} does not exist in this torch; pass --loss")
        kw = spec.get("kwargs") or {}
        shown = ", ".join(f"{k}={v!r}" for k, v in kw.items() if not isinstance(v, torch.Tensor))
        return cls(**kw), f"nn.{spec['class']}({shown})"
    if kind == "callable":
        if not trust:
            raise TrustError(f"the snapshot's loss is code ({spec['spec']}); it runs only with --trust, "
                             "or name a loss yourself with --loss")
        return resolve_callable(spec["spec"], "snapshot loss"), spec["spec"]
    raise ModelError(f"the snapshot's loss ({spec.get('repr', kind)}) cannot be rebuilt; pass --loss")


# ------------------------------------------------------------------ the exported step


class ExportStep(nn.Module):
    """What gets exported: the model and its loss, one scalar out."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs, target):
        return compute_loss(call_model(self.model, inputs), target, self.loss_fn)


class _full_stack_traces:
    """During export, keep every user frame in each node's stack trace, not only `forward` frames.

    torch.export records only frames named `forward`, so an op inside a helper function
    or a plain loss function would be blamed on the line that called it. Eager replay
    names the op's own line; this keeps the exported program consistent with it.
    It leans on a private torch hook, so it quietly does nothing where that is absent.
    """

    def __enter__(self):
        from torch.fx.proxy import TracerBase

        self.orig = getattr(TracerBase, "_filter_traceback_frames", None)
        if self.orig is None:
            return self
        orig = self.orig

        def keep_user_frames(tracer, summary):
            flag = getattr(tracer, "_record_forward_stack_traces_only", False)
            tracer._record_forward_stack_traces_only = False
            try:
                return orig(tracer, summary)
            finally:
                tracer._record_forward_stack_traces_only = flag
        TracerBase._filter_traceback_frames = keep_user_frames
        return self

    def __exit__(self, *exc):
        if self.orig is not None:
            from torch.fx.proxy import TracerBase

            TracerBase._filter_traceback_frames = self.orig
        return False


def export_step(model: nn.Module, loss_fn: Callable | None, inputs: Any, target: Any) -> torch.Tensor:
    """torch.export the model and loss; return the program as a uint8 tensor (raises on failure)."""
    with _full_stack_traces():
        ep = torch.export.export(ExportStep(model, loss_fn), (inputs, target), strict=False)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


_TRACE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n(?P<code>[^\n]*)')
_INTERNAL = ("/site-packages/torch/", "/dist-packages/torch/", "<frozen", "<eval_with_key")
_DRIVER = ("nanreplay/formats/native.py", "nanreplay/replay/subject.py", "nanreplay/capture/guard.py")


def _user_frame(stack_trace: str | None) -> tuple | None:
    """The innermost user frame of an exported node's recorded stack trace."""
    if not stack_trace:
        return None
    frames = [m.groupdict() for m in _TRACE.finditer(stack_trace)]
    for fr in reversed(frames):
        f = fr["file"]
        if f.endswith(_DRIVER):
            return None  # the op came from nanreplay's own wrapper (e.g. a built-in loss)
        if any(s in f for s in _INTERNAL) or re.search(r"/lib/python3\.\d+/(?!site-packages)", f):
            continue
        return (f, int(fr["line"]), fr["func"], fr["code"].strip() or None)
    return None


def _user_path(path: str) -> str:
    """A module path inside ExportStep -> the user's qualified name ('' root, '<loss>' for the loss)."""
    path = re.sub(r"^L\['self'\]\.?|^L__self__\.?", "", path)  # older torch spells the root this way
    if path == "model":
        return ""
    if path.startswith("model."):
        return path[len("model."):]
    return "<loss>"  # the wrapper itself or its loss_fn submodule


def _scopes(node) -> tuple[tuple[str, str], ...]:
    """The module calls an exported node ran inside, outermost first, as (call key, user path).

    The key tells two calls of one module apart (export suffixes repeated calls with '@1').
    """
    stack = node.meta.get("nn_module_stack") or {}
    out = tuple((key, _user_path(path)) for key, (path, _cls) in stack.items() if path not in ("", "L__self__"))
    return out or (("<loss>", "<loss>"),)


class _Interpreter(torch.fx.Interpreter):
    def __init__(self, gm, owner: ExportedModel):
        super().__init__(gm)
        self.owner = owner

    def run_node(self, n):
        self.owner._node = n
        return super().run_node(n)


class ExportedModel(nn.Module):
    """Runs an exported step (model + loss) so that replay sees every op with its module and line.

    Its parameters are named as in the original model (the `model.` prefix of the
    exported program is dropped), so gradient rows and leaves read naturally.
    """

    def __init__(self, ep):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.gm = ep.module()
        self.__dict__["_ep"] = ep  # not a submodule: kept to build copies cheaply
        self._node = None
        self._sites: dict = {}

    def __deepcopy__(self, memo):
        """A fresh module from the program plus a copy of the current weights.

        (A generic deepcopy would also copy every graph node's fake-tensor metadata.)
        """
        new = ExportedModel(self._ep)
        new.load_state_dict({k: v.detach().clone() for k, v in self.state_dict().items()})
        p = next(self.gm.parameters(), None)
        if p is not None:
            new.to(p.device)
        new.training = self.training
        memo[id(self)] = new
        return new

    def forward(self, inputs, target):
        flat = self.gm.graph._codegen.process_inputs(inputs, target)
        out = _Interpreter(self.gm, self).run(*flat)
        self._node = None
        return self.gm.graph._codegen.process_outputs(out)

    def site(self) -> tuple[str | None, tuple | None, tuple]:
        """(module path, user frame, module call scopes) of the op running now."""
        n = self._node
        if n is None:
            return "<loss>", None, (("<loss>", "<loss>"),)
        s = self._sites.get(n)
        if s is None:
            scopes = _scopes(n)
            s = self._sites[n] = (scopes[-1][1], _user_frame(n.meta.get("stack_trace")), scopes)
        return s

    def train(self, mode: bool = True) -> ExportedModel:
        self.training = mode  # the mode is baked into the exported graph; exported modules refuse train()
        return self

    @staticmethod
    def _strip(name: str) -> str:
        if name.startswith("gm.model."):
            return name[len("gm.model."):]
        return "<loss>." + name[len("gm."):] if name.startswith("gm.") else name

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for n, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield self._strip(n), p

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for n, b in super().named_buffers(prefix, recurse, remove_duplicate):
            yield self._strip(n), b


def load_exported(data: torch.Tensor):
    buf = io.BytesIO(data.numpy().tobytes())
    quiet = [logging.getLogger(n) for n in ("torch.export", "torch._export")]
    levels = [lg.level for lg in quiet]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation chatter from torch's deserializer
        for lg in quiet:  # a damaged program is reported by the caller in one line, not a logged traceback
            lg.setLevel(logging.CRITICAL)
        try:
            return torch.export.load(buf)
        finally:
            for lg, lv in zip(quiet, levels, strict=True):
                lg.setLevel(lv)


# ------------------------------------------------------------------ reading


_REQUIRED = ("batch", "model_state", "model", "loss_spec")


def sniff(obj: dict) -> bool:
    return obj.get("format") == FORMAT


def parse(path: str, d: dict) -> Snapshot:
    v = d.get("version")
    if not isinstance(v, int):
        raise SnapshotError(f"{path}: native snapshot without a version number")
    if v > VERSION:
        raise SnapshotError(f"{path}: snapshot format version {v} is newer than this nanreplay understands "
                         f"({VERSION}); upgrade nanreplay")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise SnapshotError(f"{path}: damaged native snapshot: missing {', '.join(missing)}")
    batch = d["batch"] or {}
    return Snapshot(path=path, format="native", inputs=batch.get("inputs"), target=batch.get("target"),
                    state=d["model_state"], keys={"inputs": "inputs", "target": "target"}, raw=d,
                    step=d.get("step"), rank=d.get("rank"), world_size=d.get("world_size"),
                    trigger=d.get("trigger"), history=list(d.get("history") or []), created=d.get("created"))


def _prepare(d: dict) -> Callable[[], None]:
    """Restore the RNG state the step started with, so dropout replays identically."""
    rng = d.get("rng") or {}
    cpu, cuda = rng.get("cpu"), rng.get("cuda")

    def prepare() -> None:
        if cpu is not None:
            torch.set_rng_state(cpu)
        else:
            torch.manual_seed(0)
        if cuda and torch.cuda.is_available() and len(cuda) <= torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    return prepare


def _autocast(d: dict, device: torch.device) -> dict | None:
    ac = d.get("autocast")
    if not ac or not ac.get("enabled", True):
        return None
    dtype = getattr(torch, str(ac.get("dtype", "float16")).removeprefix("torch."))
    # autocast follows the replay device: a CUDA fp16 step replays on CPU under CPU autocast
    return {"device_type": device.type, "dtype": dtype}


def rebuild_subject(snap: Snapshot, *, model: str | None, loss: str | None, device: str | None, trust: bool):
    """Rebuild a native snapshot's step: the user's --model, else the exported program, else (trusted) factory."""
    d = snap.raw
    dev = rebuild.parse_device(device)
    info = d.get("model") or {}
    scale = d.get("grad_scale")
    # a GradScaler step replays as it ran: backward of the scaled loss
    common = dict(autocast=_autocast(d, dev), prepare=_prepare(d),
                  loss_scale=float(scale) if scale and scale != 1.0 else None)
    if model is None and info.get("exported") is not None:
        if loss is not None:
            raise ModelError(f"{snap.path}: the snapshot's exported program includes its own loss; to replay it "
                             "with a different --loss, also name the model with --model MODULE:FACTORY")
        try:
            ep = load_exported(info["exported"])
        except Exception as e:  # noqa: BLE001 - a damaged program is one line, not a traceback
            raise SnapshotError(f"{snap.path}: the embedded exported program cannot be loaded "
                             f"({type(e).__name__}: {first_line(e)}); "
                             "analyze it with --model MODULE:FACTORY instead") from None
        m = ExportedModel(ep)
        m.to(dev)
        return Subject(
            model=m, inputs=(to_device(snap.inputs, dev), to_device(snap.target, dev)),
            target=None, loss_fn=None, loss_name=_loss_label(d.get("loss_spec") or {}), device=dev,
            how="exported program in the snapshot (no training code needed)", site=m.site,
            model_class=str(info.get("class") or "").rsplit(".", 1)[-1] or None,
            input_label="inputs[0]", target_label="inputs[1]", **common)
    if model is not None:
        m, how = build_model(model), f"--model {model}"
    else:
        spec = info.get("factory")
        why = f" (export failed: {info['export_error']})" if info.get("export_error") else ""
        if not spec:
            raise ModelError(f"{snap.path}: the snapshot holds no exported program{why} and names no factory; "
                             "pass --model MODULE:FACTORY")
        if not trust:
            raise TrustError(f"{snap.path}: the snapshot names code to rebuild its model ({spec!r}){why}; "
                             f"it runs only with --trust, or name the model yourself with --model MODULE:FACTORY")
        m, how = build_model(spec), f"factory {spec} from the snapshot (--trust){why}"
    m.train(bool(d.get("model_training", True)))
    if loss is not None:
        loss_fn, loss_name = resolve_loss(loss), loss
    else:
        loss_fn, loss_name = loss_from_spec(d.get("loss_spec") or {"kind": "output"}, trust=trust)
    return rebuild.eager_subject(snap, m, how, loss_fn, loss_name, dev, **common)


def _loss_label(spec: dict) -> str | None:
    k = spec.get("kind")
    return {"functional": f"F.{spec.get('name')}", "module": f"nn.{spec.get('class')}",
            "callable": spec.get("spec")}.get(k)


def describe(snap: Snapshot) -> dict:
    raw, model = snap.raw, snap.raw.get("model") or {}
    return dict(loss_value=raw.get("loss_value"), grad_norm=raw.get("grad_norm"),
                environment=raw.get("environment"), export_error=model.get("export_error"),
                factory=model.get("factory"), model_class=model.get("class"),
                loss_spec={k: v for k, v in (raw.get("loss_spec") or {}).items() if k != "kwargs"},
                autocast=raw.get("autocast"), grad_scale=raw.get("grad_scale"),
                nanreplay_version=raw.get("nanreplay_version"))


NATIVE = Format("native", "native snapshot", sniff, parse, rebuild_subject, describe)
