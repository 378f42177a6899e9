"""The native snapshot: what `NanGuard` writes. One `torch.save` of a plain, versioned dict.

Version 2 (this nanreplay) holds the step as data — a step program (`formats/program.py`) —
next to the tensors it names, each stored once:

    format, version, created, nanreplay_version, trigger, step, micro_batch, rank, world_size,
    loss_value, grad_norm, grad_scale, batch, state (parameters and buffers as the step began),
    parameters, aliases (tied names), model_training, constants, step_program, program_error,
    model {class, factory, factory_source, arguments}, loss_spec, optimizer, rng, autocast, environment,
    history, notes, rerun (the guard's re-run beside the training step), machine (host, device, run),
    sites (where the optimizer, scheduler and autocast were made: text re-checked, never run; docs/sites.md),
    update (trigger "update" only: what a replay of the optimizer step needs,
    formats/update_record.py; the `state` of such a snapshot holds the weights before the update)

It loads with `torch.load(weights_only=True)`, every field is checked against the schema below
before anything is built, and the program is validated and dry-run on the meta device. A model
factory (code) is used only where no program could be recorded, and only with `--trust`.

Version 1 (nanreplay 0.1) embedded a `torch.export` archive. That archive is never opened
(loading one can run code); a version-1 file is analyzed only with `--model`, and the message
says to re-capture.
"""

from __future__ import annotations

import torch

from nanreplay.enums import Trigger
from nanreplay.errors import LimitError, ModelError, SnapshotError, TrustError, UsageError
from nanreplay.formats import schema as S
from nanreplay.formats import update_record
from nanreplay.formats.base import Format, Snapshot
from nanreplay.formats.dryrun import dry_run, same_objects
from nanreplay.formats.loss_spec import loss_from_spec, loss_label
from nanreplay.formats.program import DTYPES, check_frame, decode
from nanreplay.formats.rebuild import eager_subject, parse_device
from nanreplay.formats.stepmodel import StepModule
from nanreplay.formats.usercode import build_model, resolve_callable, resolve_loss
from nanreplay.replay.subject import Subject, to_device

# Bump VERSION on any incompatible change and say why here.
#   1 — nanreplay 0.1: the step as a torch.export archive (never loaded since 0.2).
#   2 — the step as a validated step program; tensors stored once; buffers as the step began.
FORMAT = "nanreplay.snapshot"
VERSION = 2

_AUTOCAST = S.record({"device_type": S.optional(S.one_of("cpu", "cuda", "xpu", "mps", "hpu")),
                      "dtype": S.one_of(*DTYPES), "enabled": S.optional(S.boolean)}, required=("dtype",))
_RNG = S.record({"cpu": S.optional(S.tensor((torch.uint8,), 1)),
                 "cuda": S.optional(S.list_of(S.tensor((torch.uint8,), 1), 1024))})
_HISTORY_ROW = S.record({"step": S.optional(S.integer()), "micro_batch": S.optional(S.integer()),
                         "loss": S.optional(S.number), "grad_norm": S.optional(S.number),
                         "lr": S.optional(S.number), "scale": S.optional(S.number),
                         "overflow": S.optional(S.boolean), "clip": S.optional(S.number),
                         "base_lr": S.optional(S.number)})
_MODEL = S.record({"class": S.optional(S.string(500)), "factory": S.optional(S.string(500)),
                   "factory_source": S.optional(S.string(300)), "arguments": S.optional(S.string(1 << 20))})
_LOSS_SPEC = S.record({"kind": S.one_of("output", "functional", "module", "callable", "unknown", "step_fn"),
                       "name": S.optional(S.string(100)), "class": S.optional(S.string(100)),
                       "spec": S.optional(S.string(500)), "repr": S.optional(S.string(500)),
                       "kwargs": S.optional(S.dict_of(lambda v, w: v if isinstance(v, torch.Tensor)
                                                      else S.plain_value(v, w), limit=64))},
                      required=("kind",))
_ENV = S.dict_of(S.plain_value, limit=64)
# the guard's re-run beside the training step, and the machine (capture/rerun.py; docs/snapshot-format.md)
_HASH = S.optional(S.string(64))
_RUN_SUMMARY = S.record({"loss": S.optional(S.number), "loss_finite": S.optional(S.boolean), "loss_hash": _HASH,
                         "grad_norm": S.optional(S.number), "grads_nonfinite": S.optional(S.integer(0)),
                         "grads_hash": _HASH, "grads_error": S.optional(S.string(300))})
_RERUN = S.record({
    "training": S.optional(_RUN_SUMMARY), "rerun": S.optional(_RUN_SUMMARY), "why_not": S.optional(S.string(2000)),
    "comparable": S.optional(S.record({"loss": S.optional(S.boolean), "grads": S.optional(S.boolean),
                                       "why": S.optional(S.string(2000))})),
    "random_ops": S.optional(S.list_of(S.record({"op": S.string(200), "device": S.string(40),
                                                 "generator": S.string(100)}, required=("op",)), 1000)),
    "random_count": S.optional(S.integer(0)), "random_unrecorded": S.optional(S.integer(0)),
    "deterministic": S.optional(S.record({k: S.optional(S.boolean) for k in
                                          ("algorithms", "warn_only", "cudnn_deterministic", "cudnn_benchmark")})),
    "compiled": S.optional(S.boolean), "seconds": S.optional(S.number)})
_MACHINE = S.record({"host": S.optional(S.string(200)), "device": S.optional(S.string(100)),
                     "device_name": S.optional(S.string(200)), "device_index": S.optional(S.integer(0, 10**6)),
                     "local_rank": S.optional(S.integer(0, 10**7)), "run": S.optional(S.string(200)),
                     "capability": S.optional(S.string(20))})  # a CUDA device's compute capability, "8.6"


def _state_dict(v, where):
    """An optimizer's state dict: a dict of plain values and CPU tensors, every string and number checked
    (diagnose/late.py then reads its structure)."""
    if not isinstance(v, dict):
        raise S.SchemaError(f"{where} must be a dict, not a {type(v).__name__}")
    return S.batch_tree(v, where)


def _entry(v, where):
    """The line that gave begin() the batch (capture/snapshot.py entry_record): a program frame's checks."""
    try:
        return check_frame(v, 0, where or "entry")
    except Exception as e:  # noqa: BLE001 - the program's own check error, said as a schema error
        raise S.SchemaError(str(e)) from None


def _construction(v, where):
    """Where an nn.Sequential was built (capture/construct.py): its container's path, the statement as a frame, and
    where the call starts in it."""
    if not isinstance(v, dict) or set(v) - {"module", "file", "line", "function", "code", "context", "call"}:
        raise S.SchemaError(f"{where} must be an object with module, file, line, function, code, context, call")
    call = v.get("call")
    if not (isinstance(call, list) and len(call) == 2 and all(type(c) is int and 0 <= c < 10**7 for c in call)):
        raise S.SchemaError(f"{where}.call must be [line, column]")
    f = _entry({k: v.get(k) for k in ("file", "line", "function", "code", "context")}, where)
    ctx = f["context"]
    if ctx is None or not ctx[0] <= call[0] < ctx[0] + len(ctx[1]):
        raise S.SchemaError(f"{where}.call is not in its statement's lines")
    return {**f, "module": S.string(1000)(v.get("module"), f"{where}.module"), "call": call}


# where the optimizer, scheduler and autocast were made (capture/sites.py): data, re-checked before any rewrite
_SITE = S.record({"what": S.one_of("optimizer", "scheduler", "autocast", "lr_write"), "class": S.string(100),
                  "file": S.string(4096), "line": S.integer(1, 10**7), "call_line": S.optional(S.integer(1, 10**7)),
                  "text": S.string(4000), "values": S.optional(S.dict_of(S.number, limit=16)),
                  "evidence": S.optional(S.string(1000)),
                  "via": S.optional(S.record({"kind": S.one_of("name", "attribute", "key"), "name": S.string(200)},
                                             required=("kind", "name")))},
                 required=("what", "class", "file", "line", "text"))
_FRAME = S.record({"file": S.string(4096), "line": S.integer(0), "function": S.optional(S.string(1000)),
                   "code": S.optional(S.string(2000))})  # a source line the guard saw (capture/flow.py)
FIELDS_V2: dict[str, S.Checker] = {
    "format": S.string(100), "version": S.integer(1, 1000),
    "created": S.optional(S.string(64)), "nanreplay_version": S.optional(S.string(64)),
    "trigger": S.optional(S.one_of(*[t.value for t in Trigger])),
    "step": S.optional(S.integer()), "micro_batch": S.optional(S.integer(0)),
    "rank": S.optional(S.integer(0, 10**7)), "world_size": S.optional(S.integer(1, 10**7)),
    "nonfinite_ranks": S.optional(S.list_of(S.integer(0, 10**7), 100_000)),
    "loss_value": S.optional(S.number), "grad_norm": S.optional(S.number), "grad_scale": S.optional(S.number),
    "spike_median": S.optional(S.number), "record_seconds": S.optional(S.number),
    "gradient_flow": S.optional(S.record({
        "dead": S.list_of(S.record({"name": S.string(1000), "gradient": S.one_of("none", "zero", "frozen"),
                                    "had_gradient": S.optional(S.boolean),
                                    "zero_steps": S.optional(S.integer(0))}), 100_000),
        "frozen": S.optional(S.list_of(S.string(1000), 100_000)), "all_zero": S.optional(S.boolean),
        "reentrant_checkpoint": S.optional(S.boolean),
        "checkpoint_call": S.optional(_FRAME), "checkpoint_caller": S.optional(_FRAME),
        "vanished": S.optional(S.list_of(S.record({"module": S.string(1000), "norm": S.optional(S.number),
                                                   "share": S.optional(S.number), "median_share": S.optional(S.number),
                                                   "steps": S.optional(S.integer(0)),
                                                   "total_norm": S.optional(S.number),
                                                   "floor": S.optional(S.number),
                                                   "first_shares": S.optional(S.list_of(S.number, 64))}),
                                     100_000))})),
    "batch": S.record({"inputs": S.batch_tree, "target": S.batch_tree, "batch": S.batch_tree}),
    "state": S.dict_of(S.tensor()), "parameters": S.list_of(S.string(1000)),
    "input_names": S.optional(S.list_of(S.string(200), 64)),
    "aliases": S.optional(S.dict_of(S.string(1000))), "model_training": S.optional(S.boolean),
    "constants": S.optional(S.dict_of(S.tensor())),
    "step_program": S.optional(S.string(2**31)), "program_error": S.optional(S.string(2000)),
    "model": S.optional(_MODEL), "loss_spec": S.optional(_LOSS_SPEC),
    "optimizer": S.optional(S.record({"class": S.optional(S.string(200)),
                                      "state_dict": S.optional(_state_dict),
                                      "param_names": S.optional(update_record.optimizer_param_names)})),
    "update": S.optional(update_record.check),
    "rng": S.optional(_RNG), "autocast": S.optional(_AUTOCAST), "environment": S.optional(_ENV),
    "history": S.optional(S.list_of(_HISTORY_ROW, 100_000)), "notes": S.optional(S.list_of(S.string(2000), 50)),
    "rerun": S.optional(_RERUN), "machine": S.optional(_MACHINE), "entry": S.optional(_entry),
    "constructions": S.optional(S.list_of(_construction, 50)), "sites": S.optional(S.list_of(_SITE, 16)),
}
REQUIRED_V2 = ("format", "version", "batch", "state", "parameters")

FIELDS_V1: dict[str, S.Checker] = {
    "format": S.string(100), "version": S.integer(1, 1000), "created": S.optional(S.string(64)),
    "trigger": S.optional(S.string(40)), "step": S.optional(S.integer()), "rank": S.optional(S.integer(0, 10**7)),
    "world_size": S.optional(S.integer(1, 10**7)), "loss_value": S.optional(S.number),
    "grad_norm": S.optional(S.number), "batch": S.record({"inputs": S.batch_tree, "target": S.batch_tree}),
    "model_state": S.dict_of(S.tensor()), "model_training": S.optional(S.boolean),
    "loss_spec": S.optional(_LOSS_SPEC), "rng": S.optional(_RNG), "autocast": S.optional(_AUTOCAST),
    "grad_scale": S.optional(S.number), "history": S.optional(S.list_of(_HISTORY_ROW, 100_000)),
    "model": S.optional(S.record({"class": S.optional(S.string(500)), "factory": S.optional(S.string(500))})),
}


def sniff(obj: dict) -> bool:
    return obj.get("format") == FORMAT


def parse(path: str, d: dict) -> Snapshot:
    v = S.format_version(d, path, "native snapshot", VERSION)
    fields, required = (FIELDS_V2, REQUIRED_V2) if v >= 2 else (FIELDS_V1, ("batch", "model_state"))
    try:
        clean = S.record(fields, required=required)(d, "")
    except S.SchemaError as e:
        raise SnapshotError(f"{path}: damaged native snapshot: {e}") from None
    batch = clean["batch"]
    state = clean["state"] if v >= 2 else clean["model_state"]
    if v >= 2:
        unknown = [n for n in clean["parameters"] if n not in state]
        if unknown:
            raise SnapshotError(f"{path}: damaged native snapshot: parameters names {unknown[0]!r}, which state lacks")
        aliases = clean.get("aliases") or {}
        bad = [a for a, t in aliases.items() if t not in state or a in state]
        if bad:
            raise SnapshotError(f"{path}: damaged native snapshot: alias {bad[0]!r} does not name a stored tensor")
        state = {**state, **{a: state[t] for a, t in aliases.items()}}  # tied names, for eager models (--model)
        if clean.get("update") is not None:
            bad_update = update_record.cross_check(clean["update"], state)
            if bad_update:
                raise SnapshotError(f"{path}: damaged native snapshot: {bad_update}")
    inputs, target = (batch["batch"], None) if "batch" in batch else (batch.get("inputs"), batch.get("target"))
    return Snapshot(path=path, format="native", inputs=inputs, target=target, state=state,
                    keys={"inputs": "inputs", "target": "target"}, raw=clean, step=clean.get("step"),
                    rank=clean.get("rank"), world_size=clean.get("world_size"), trigger=clean.get("trigger"),
                    history=list(clean.get("history") or []), created=clean.get("created"))


def _prepare(d: dict):
    """Restore the RNG state the step started with, so eager dropout replays identically."""
    rng = d.get("rng") or {}
    cpu, cuda = rng.get("cpu"), rng.get("cuda")

    def prepare() -> None:
        if cpu is not None:
            try:
                torch.set_rng_state(cpu)
            except (RuntimeError, ValueError, TypeError):
                torch.manual_seed(0)
        else:
            torch.manual_seed(0)
        if cuda and torch.cuda.is_available() and len(cuda) <= torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    return prepare


def _autocast(d: dict, device: torch.device) -> dict | None:
    ac = d.get("autocast")
    if not ac or ac.get("enabled") is False:
        return None
    # autocast follows the replay device: a CUDA fp16 step replays on CPU under CPU autocast
    return {"device_type": device.type, "dtype": DTYPES[ac["dtype"]]}


def rebuild_subject(snap: Snapshot, *, model: str | None, loss: str | None, device: str | None, trust: bool,
                    max_memory: int | None = None) -> Subject:
    """The step as recorded (no code runs), or the user's --model, or — with --trust — the snapshot's factory."""
    d = snap.raw
    dev = parse_device(device)
    common = replay_options(d, dev)
    if model is None and d["version"] >= 2 and d.get("step_program") is not None:
        if loss is not None:
            raise UsageError(f"{snap.path}: the snapshot's step program includes its own loss; to replay it "
                             "with a different --loss, also name the model with --model MODULE:FACTORY")
        return program_subject(snap, dev, max_memory, common)
    if model is not None:
        m, how = build_model(model), f"--model {model}"
    else:
        m, how = _factory_model(snap, trust)
    m.train(bool(d.get("model_training", True)))
    spec = d.get("loss_spec") or {}
    if spec.get("kind") == "step_fn":  # the loop gave step_fn(model, batch): the step is that function on the batch
        step_fn, name = _step_fn(snap, spec, loss, trust)
        return eager_subject(snap, m, how, None, name, dev, step_fn=step_fn, **common)
    if loss is not None:
        loss_fn, loss_name = resolve_loss(loss), loss
    else:
        loss_fn, loss_name = loss_from_spec(d.get("loss_spec") or {"kind": "output"}, trust=trust)
    return eager_subject(snap, m, how, loss_fn, loss_name, dev, **common)


def _step_fn(snap: Snapshot, spec: dict, loss: str | None, trust: bool):
    """The step function of a step_fn snapshot rebuilt from code: --loss MODULE:CALLABLE names it, or --trust
    imports the one the snapshot names (a function defined in a script run as __main__ is not importable)."""
    named = loss or spec.get("spec")
    if not named or ":" not in named or named.startswith("__main__:"):
        why = f" ({named} is the script that was run, not an importable module)" if named else ""
        raise ModelError(f"{snap.path}: the snapshot's step is a step_fn(model, batch){why}; name it with --loss "
                         "MODULE:CALLABLE")
    if loss is None and not trust:
        raise TrustError(f"{snap.path}: the snapshot's step is code ({named}); it runs only with --trust, or name "
                         "it yourself with --loss MODULE:CALLABLE")
    return resolve_callable(named, "--loss" if loss else "snapshot step_fn"), named


def replay_options(d: dict, dev: torch.device) -> dict:
    """How a step replays (Subject fields): autocast, the RNG it starts from, a GradScaler's scale."""
    scale = d.get("grad_scale")
    return dict(autocast=_autocast(d, dev), prepare=_prepare(d), loss_scale=float(scale) if scale and scale != 1.0 else None)


def _factory_model(snap: Snapshot, trust: bool):
    d = snap.raw
    info = d.get("model") or {}
    spec = info.get("factory")
    if d["version"] < 2:
        raise ModelError(f"{snap.path}: written by nanreplay 0.1 (snapshot format 1), whose embedded torch.export "
                         "program is never loaded (opening one can run code); re-capture with this nanreplay, "
                         "or analyze it with --model MODULE:FACTORY")
    why = f" (no step program: {d['program_error']})" if d.get("program_error") else ""
    if not spec:
        how = f" ({info['factory_source']})" if info.get("factory_source") else ""
        raise ModelError(f"{snap.path}: the snapshot holds no step program{why} and names no factory{how}; "
                         "pass --model MODULE:FACTORY")
    if not trust:
        raise TrustError(f"{snap.path}: the snapshot names code to rebuild its model ({spec!r}){why}; "
                         "it runs only with --trust, or name the model yourself with --model MODULE:FACTORY")
    arguments = info.get("arguments")
    shown = f"{spec}(<{len(arguments)} characters of recorded arguments>)" if arguments else spec
    return build_model(spec, arguments), f"factory {shown} from the snapshot (--trust){why}"


def program_subject(snap: Snapshot, dev: torch.device, max_memory: int | None, common: dict) -> Subject:
    """The step as its program (snap.raw: step_program, constants, batch, parameters, aliases, model, loss_spec,
    model_training; snap.state, inputs, target): leaves checked, dry-run, memory bounded. No code runs."""
    d = snap.raw
    program = decode(d["step_program"])
    constants = d.get("constants") or {}
    step_fn = "batch" in d["batch"]
    batch = {"batch": snap.inputs} if step_fn else {"inputs": snap.inputs, "target": snap.target}
    module = StepModule(program, snap.state, d["parameters"], d.get("aliases") or {}, constants, step_fn=step_fn)
    leaf_meta, values, tensors = {}, {}, {}
    for lf in program.leaves:
        try:
            t = module.leaf_tensor(lf, batch)
        except (KeyError, IndexError, TypeError) as e:
            raise SnapshotError(f"{snap.path}: invalid step program: {lf.kind} {lf.name!r} is not in the snapshot "
                                f"({type(e).__name__})") from None
        if list(t.shape) != lf.shape or DTYPES[lf.dtype] != t.dtype:
            raise SnapshotError(f"{snap.path}: invalid step program: {lf.kind} {lf.name!r} is "
                                f"{list(t.shape)} {t.dtype}, the program says {lf.shape} {lf.dtype}")
        leaf_meta[lf.ref] = (lf.shape, t.dtype)
        if lf.kind != "constant":  # (a replay clones its constants: they never alias)
            tensors[lf.ref] = t
        if not (t.is_floating_point() or t.is_complex()):
            values[lf.ref] = t  # stored indices: checked against what they index before any kernel runs
    try:
        bound = dry_run(program, leaf_meta, values=values, max_memory=max_memory, same=same_objects(tensors))
    except SnapshotError as e:
        raise SnapshotError(f"{snap.path}: {e}") from None
    except LimitError as e:
        raise LimitError(f"{snap.path}: {e}") from None
    if max_memory is not None and bound > max_memory:
        raise LimitError(f"{snap.path}: replaying this step needs about {_gb(bound)} (bounded from the step "
                         f"program's shapes), more than --max-memory {_gb(max_memory)}; raise the limit if this "
                         "machine has the memory")
    module.train(bool(d.get("model_training", True)))
    module.to(dev)
    info = d.get("model") or {}
    cls = str(info.get("class") or "").rsplit(".", 1)[-1] or None
    return Subject(model=module, inputs=to_device(snap.inputs, dev), target=to_device(snap.target, dev), loss_fn=None,
                   loss_name=loss_label(d.get("loss_spec") or {}), device=dev,
                   how="step program in the snapshot (no training code needed)", site=module.site,
                   model_class=cls, input_label="batch" if step_fn else "inputs", target_label="target",
                   program=True, memory_bound=bound, input_names=None if step_fn else d.get("input_names"),
                   constructions=d.get("constructions"), **common)


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def describe(snap: Snapshot) -> dict:
    raw = snap.raw
    model = raw.get("model") or {}
    return dict(loss_value=raw.get("loss_value"), grad_norm=raw.get("grad_norm"),
                environment=raw.get("environment"), program_error=raw.get("program_error"),
                export_error=raw.get("program_error"),
                factory=model.get("factory"), model_class=model.get("class"),
                loss_spec={k: v for k, v in (raw.get("loss_spec") or {}).items() if k != "kwargs" and v is not None},
                autocast=raw.get("autocast"), grad_scale=raw.get("grad_scale"), micro_batch=raw.get("micro_batch"),
                nanreplay_version=raw.get("nanreplay_version"), format_version=raw.get("version"),
                nonfinite_ranks=raw.get("nonfinite_ranks"), spike_median=raw.get("spike_median"),
                **({"gradient_flow": raw["gradient_flow"]} if raw.get("gradient_flow") is not None else {}),
                record_seconds=raw.get("record_seconds"),
                optimizer=_optimizer_summary(raw.get("optimizer")),
                notes=raw.get("notes") or [])


def _optimizer_summary(opt: dict | None) -> dict | None:
    """The optimizer's class and its first parameter group's learning rate (for the diagnosis' numbers)."""
    if not isinstance(opt, dict):
        return None
    groups = (opt.get("state_dict") or {}).get("param_groups") if isinstance(opt.get("state_dict"), dict) else None
    group = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], dict) else {}
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor) and lr.numel() == 1:
        lr = float(lr)
    return {"class": opt.get("class"), "lr": lr if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None}


NATIVE = Format("native", "native snapshot", sniff, parse, rebuild_subject, describe)
