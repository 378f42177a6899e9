"""What the guard's re-run of the failing step gave, beside what the training step gave: the machine's evidence.

The guard records a failing step by running it once more, right away, in the same process on the same device,
from the state `begin()` kept (`snapshot.record`). This module summarises both runs the same way — the loss, its
bits, the gradient norm, how many gradient entries are non-finite, a hash of the gradients' bits — and says what
makes the step nondeterministic by declaration (random ops drawn from a generator the guard did not record, the
deterministic-algorithms flags, a compiled training step re-run eagerly), and which machine ran it (host, device,
rank, run). All of it is plain data: the snapshot's `rerun` and `machine` fields (docs/snapshot-format.md);
`nanreplay/differential/machine.py` reads them. Only failing steps pay for any of it. This module imports only torch.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import time
import uuid
from typing import Any

import torch

from nanreplay import torch_internals as ti
from nanreplay.formats.program import is_random_call

MAX_RANDOM = 50  # random ops listed (all are counted)
_CHUNK = 1 << 22  # elements hashed at a time (bounds the hash's scratch memory)
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float64: torch.int64}
GRAD_TRIGGERS = ("gradient", "grad_norm_overflow", "grad_spike")


def loss_summary(value: float | None) -> dict:
    """The loss as the guard read it (a Python float: exact for fp16/bf16/fp32 losses), and its 64 bits."""
    if value is None:
        return {"loss": None, "loss_finite": None, "loss_hash": None}
    v = float(value)
    return {"loss": v, "loss_finite": v == v and abs(v) != float("inf"), "loss_hash": struct.pack("<d", v).hex()}


def grads_summary(grads: list[torch.Tensor | None]) -> dict:
    """The gradients' float32 global norm, non-finite entries, and a hash of their bits (None entries: no gradient).

    The hash is two int64 sums per tensor of its elements' bit patterns (one plain, one weighted by position), made
    on the tensor's own device, fetched in one transfer and folded with blake2b: one changed bit anywhere changes
    it; equal hashes from the same parameters in the same order mean bitwise-equal gradients for all practical
    purposes. Costs two passes over the gradients."""
    gs = [g.detach() for g in grads if g is not None]
    if not gs:
        return {"grad_norm": None, "grads_nonfinite": None, "grads_hash": None}
    parts: list[torch.Tensor] = []
    for g in gs:
        flat = ti.real_values(g).reshape(-1)
        bad = (~torch.isfinite(flat)).sum() if flat.is_floating_point() else flat.new_zeros((), dtype=torch.int64)
        ints = flat.view(_BITS[flat.dtype]) if flat.dtype in _BITS else flat.double().view(torch.int64)
        s1 = torch.zeros((), dtype=torch.int64, device=flat.device)
        s2 = torch.zeros((), dtype=torch.int64, device=flat.device)
        for lo in range(0, ints.numel(), _CHUNK):
            part = ints[lo:lo + _CHUNK].to(torch.int64)
            s1 += part.sum()
            w = torch.arange(lo, lo + part.numel(), device=part.device, dtype=torch.int64) % 65521 + 1
            s2 += (part * w).sum()
        parts.append(torch.stack([s1, s2, bad.to(torch.int64), torch.tensor(ints.numel(), device=flat.device)]).cpu())
    sums = torch.stack(parts).tolist()  # the one host sync
    norms = ti.foreach_norm(gs, torch.float32)
    norm = float(torch.linalg.vector_norm(torch.stack([n.float().cpu() for n in norms])))
    h = hashlib.blake2b(repr(sums).encode(), digest_size=8).hexdigest()
    return {"grad_norm": norm, "grads_nonfinite": int(sum(r[2] for r in sums)), "grads_hash": h}


class RandomWatch:
    """Notes every random op of the re-run and whether the guard recorded the generator it drew from.

    The re-run restores torch's default CPU generator, and the CUDA ones where CUDA was initialised at
    `begin()`; a random op given its own `generator=`, or on another device, draws numbers the training step
    did not: the re-run is not the same computation."""

    def __init__(self, rng: dict):
        self.cuda_recorded = rng.get("cuda") is not None
        self.ops: list[dict] = []
        self.count = 0
        self.unrecorded = 0

    def see(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        try:
            if is_random_call(func, args, kwargs):
                self._random(func, args, kwargs, out)
        except Exception:  # noqa: BLE001, S110 - an observer never breaks the step (an op it cannot read: not noted)
            pass

    def _random(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        gen = kwargs.get("generator")
        if gen is None:
            gen = next((a for a in args if isinstance(a, torch.Generator)), None)
        t = out if isinstance(out, torch.Tensor) else next((x for x in out if isinstance(x, torch.Tensor)), None) \
            if isinstance(out, (tuple, list)) else None
        device = t.device.type if t is not None else "cpu"
        if gen is not None:
            how = "own generator"
        elif device == "cpu" or (device == "cuda" and self.cuda_recorded):
            how = "recorded"
        else:
            how = f"{device} generator not recorded"
        self.count += 1
        self.unrecorded += how != "recorded"
        if len(self.ops) < MAX_RANDOM:
            self.ops.append({"op": str(func)[:200], "device": device, "generator": how})


def deterministic_state() -> dict:
    cudnn = torch.backends.cudnn
    return {"algorithms": bool(torch.are_deterministic_algorithms_enabled()),
            "warn_only": bool(torch.is_deterministic_algorithms_warn_only_enabled()),
            "cudnn_deterministic": bool(cudnn.deterministic), "cudnn_benchmark": bool(cudnn.benchmark)}


def record(*, trigger: str, training: dict, rerun_loss: torch.Tensor | None, params: list[torch.Tensor],
           random: RandomWatch | None, comparable: dict, compiled: bool, why_not: str | None, t0: float) -> dict:
    """The snapshot's `rerun` field. `training`: the training step's summaries (loss_summary | grads_summary);
    `rerun_loss`: the loss tensor the re-run computed (None: it did not get that far, `why_not` says why)."""
    rerun: dict | None = None
    if rerun_loss is not None:
        try:
            rerun = loss_summary(float(rerun_loss.detach().float()))
            if trigger in GRAD_TRIGGERS and rerun_loss.requires_grad:
                want = [p for p in params if p.requires_grad]
                grads = torch.autograd.grad(rerun_loss, want, allow_unused=True)
                rerun.update(grads_summary(list(grads)))
                del grads
        except Exception as e:  # noqa: BLE001 - the record is evidence, never a reason to lose the snapshot
            rerun, why_not = None, f"summarising the re-run raised {type(e).__name__}: {str(e)[:300]}"
    return {"training": training, "rerun": rerun, "why_not": why_not, "comparable": comparable,
            "random_ops": list(random.ops) if random else [], "random_count": random.count if random else 0,
            "random_unrecorded": random.unrecorded if random else 0,
            "deterministic": deterministic_state(), "compiled": bool(compiled),
            "seconds": round(time.perf_counter() - t0, 4)}


def identity(model: torch.nn.Module, given: dict | None) -> dict:
    """The snapshot's `machine` field: which host, device and run wrote it (`given`: NanGuard(identity=...))."""
    given = dict(given or {})
    p = next(model.parameters(), None)
    dev = p.device if p is not None else torch.device("cpu")
    index = dev.index if dev.index is not None else (torch.cuda.current_device() if dev.type == "cuda" else None)
    name = capability = None
    if dev.type == "cuda":
        try:
            name = torch.cuda.get_device_name(index)
            capability = "{}.{}".format(*torch.cuda.get_device_capability(index))  # bfloat16 needs 8.0 (Ampere)
        except Exception:  # noqa: BLE001 - a name is a courtesy
            pass
    device = f"{dev.type}:{index}" if index is not None else dev.type
    local = os.environ.get("LOCAL_RANK")
    return {"host": str(given.get("host") or socket.gethostname())[:200],
            "device": str(given.get("device") or device)[:100],
            "device_name": str(given["device_name"])[:200] if given.get("device_name") else name,
            "device_index": index if "device" not in given else None,
            "local_rank": int(local) if local and local.isdigit() else None,
            "run": str(given.get("run") or default_run())[:200], "capability": capability}


_RUN: list[str] = []


def default_run() -> str:
    """The run a snapshot belongs to: the launcher's job id (torchelastic, SLURM), else one id per process."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(var) and os.environ[var] != "none":
            return f"{var.split('_')[0].lower()}-{os.environ[var]}"
    if not _RUN:
        _RUN.append(f"pid{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return _RUN[0]


# ------------------------------------------------------------------ the guard's side (NanGuard._to_dict calls these)


def identity_arg(identity: dict | None) -> dict | None:
    """NanGuard(identity=...) checked when the guard is made, never found wrong at the failure."""
    from nanreplay.errors import GuardError

    if identity is None:
        return None
    if not isinstance(identity, dict) or set(identity) - {"host", "device", "device_name", "run"} or \
            not all(isinstance(v, str) and v for v in identity.values()):
        raise GuardError("NanGuard(identity=...) takes a dict of non-empty strings with the keys host, device, "
                         "device_name and run (each optional)")
    return dict(identity)


def training_summary(guard: Any, trigger: str, st: Any) -> dict:
    """The training step's loss (as loss_ok() read it) and, for a gradient trigger, its gradients as they are."""
    out = loss_summary(st.loss if st is not None else None)
    if trigger in GRAD_TRIGGERS:
        try:
            out.update(grads_summary([p.grad for p in guard.model.parameters() if p.requires_grad]))
        except Exception as e:  # noqa: BLE001 - evidence, never a reason to lose the snapshot
            out["grads_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def guard_record(guard: Any, trigger: str, st: Any, training: dict, loss: torch.Tensor | None,
                 watch: RandomWatch | None, why: str | None, t0: float) -> dict:
    """The snapshot's `rerun` field: the guard's re-run (`loss`, None if there was none) beside the training step."""
    from nanreplay.capture.snapshot import is_compiled

    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    not_grads = [w for w, on in (
        ("the gradients were accumulated over several micro-batches", len(guard._states) > 1),
        ("a GradScaler scaled the gradients", guard.scaler is not None),
        ("grads_ok() was given the norm: clip_grad_norm_ may have rescaled them", guard._norm_given),
        ("the all-reduce averaged them across ranks", world > 1)) if on]
    comparable = {"loss": not st.loss_scaled, "grads": trigger in GRAD_TRIGGERS and not not_grads,
                  "why": "; ".join((["loss_ok() was given scaled_by"] if st.loss_scaled else []) + not_grads) or None}
    why_not = None
    if loss is None:
        why_not = why or "the re-run computed no loss"
        why_not = f"the guard did not re-run the step: {why_not}" if watch is None else \
            f"the re-run did not finish: {why_not}"
    return record(trigger=str(trigger), training=training, rerun_loss=loss, params=list(guard.model.parameters()),
                  random=watch, comparable=comparable, compiled=is_compiled(guard.wrapped), why_not=why_not, t0=t0)
