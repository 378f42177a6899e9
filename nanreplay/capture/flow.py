"""Gradients that stop flowing: the guard's triggers `no_gradient` and `gradient_died` (docs/flow.md).

On a healthy step the check costs what the guard's norm already cost: the per-parameter norms of one fused
`_foreach_norm` give the total norm *and* the count of exactly-zero gradients, read back in the same host sync;
the parameters with no gradient at all are found in the Python loop that gathers the gradients anyway. Only
when a trained parameter (one in the optimizer's param groups, read at check time) has no gradient or an
exactly-zero one does the expensive question come: does its value reach the loss? The step is recorded again
(the same re-run a snapshot makes, on state the guard owns) and the recorded program's data flow answers it.
A parameter whose value does not reach the loss (its module did not run, its output was dropped: an unrouted
expert, a pooler) is *unused*, not cut: it is excused and checked again after exponentially more steps.

Policy, so that routine zeros do not fire:
* no gradient (None) on a parameter whose value reaches the loss: fires at once (`no_gradient` when it never
  had one, `gradient_died` when it had): the path from it to the loss is cut, which no later step repairs;
* an exactly-zero gradient: fires after `patience` consecutive steps of it (a zero-initialised gate, LoRA's
  B = 0 or adaLN-zero give exact zeros on the first step only);
* a step whose every gradient is exactly zero (a GRPO group whose rewards are all equal has zero advantage)
  is counted, not fired on, until `all_zero_steps` of them come in a row;
* a frozen parameter (requires_grad=False) fires only when it is tied to a trained parameter's module: it is
  shared under two names and a module holding it trains its other parameters (a tied decoder weight frozen by
  freezing the embedding). Other frozen parameters next to trained ones are listed in the snapshot, no more.
`NanGuard(..., check_flow=False)` silences all of it. This module imports only torch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn

from nanreplay import torch_internals as ti
from nanreplay.capture import snapshot
from nanreplay.enums import Trigger
from nanreplay.replay.frames import user_frames_from

log = logging.getLogger("nanreplay")

PATIENCE = 3  # consecutive steps of an exactly-zero gradient before it fires
ALL_ZERO_STEPS = 20  # consecutive steps on which every gradient is exactly zero before they fire


class FlowWatch:
    """The guard's memory of which trained parameters had gradients, and the checks on each step."""

    def __init__(self, patience: int = PATIENCE, all_zero_steps: int = ALL_ZERO_STEPS, ignore: tuple | list = ()):
        self.patience, self.all_zero_steps = max(1, int(patience)), max(1, int(all_zero_steps))
        self.ignore = tuple(str(i) for i in ignore)  # parameter names containing one of these are never reported
        self._names: dict[int, str] = {}
        self._alive: set[int] = set()  # params that ever had a non-zero gradient
        self._alive_count = -1  # the number of gradients on the last healthy step whose params were all noted
        self._zero_run: dict[int, int] = {}  # consecutive zero-gradient steps per param
        self._all_zero_run = 0
        self._excused: dict[int, tuple[int, int]] = {}  # id -> (checked again at this step, times found unused)
        self._fired: set[int] = set()
        self._frozen_checked = False
        self.pending: dict | None = None  # what the last measure() found worth the expensive check

    # ------------------------------------------------------------------ the cheap part, every step

    def trained(self, model: nn.Module, optimizer: Any) -> list[torch.Tensor]:
        """The parameters being trained: those in the optimizer's param groups now (or the model's own)."""
        if optimizer is not None and getattr(optimizer, "param_groups", None):
            params = [p for g in optimizer.param_groups for p in g.get("params", ())]
        else:
            params = list(model.parameters())
        return [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]

    def measure(self, model: nn.Module, optimizer: Any, step: int, want_norm: bool) -> float | None:
        """The total gradient norm (when `want_norm`), and the step's dead-gradient findings in `self.pending`."""
        self.pending = None
        trained = {id(p) for p in self.trained(model, optimizer)}
        params = [p for p in model.parameters() if p.grad is not None or id(p) in trained]
        with_grad = [p for p in params if p.grad is not None]
        missing = [p for p in params if p.grad is None]
        if not with_grad:
            return 0.0 if want_norm else None
        norms = torch.stack([n.float() for n in ti.foreach_norm([p.grad.detach() for p in with_grad])])
        zeros = (norms == 0).sum()
        if want_norm:
            total, nz = torch.stack([torch.linalg.vector_norm(norms), zeros.float()]).tolist()  # one host sync
        else:
            total, nz = None, float(zeros)
        nz = int(nz)
        if nz == 0:
            if self._zero_run:
                self._zero_run.clear()
            self._all_zero_run = 0
            if len(with_grad) != self._alive_count:  # first step, or the set of gradients changed
                self._alive.update(id(p) for p in with_grad)
                self._alive_count = len(with_grad)
        if nz == 0 and not missing:
            return total
        self._note_names(model)
        if nz and nz == len(with_grad):  # every gradient exactly zero: a routine zero step, until it is not
            self._all_zero_run += 1
            if self._all_zero_run >= self.all_zero_steps:
                self._all_zero_run = 0
                dead = [p for p in with_grad if id(p) not in self._fired and id(p) in trained]
                if dead:
                    self.pending = {"zero": dead, "none": [], "all_zero": True}
            return total
        self._all_zero_run = 0
        zero: list[torch.Tensor] = []
        if nz:
            flags = (norms == 0).tolist()
            for p, z in zip(with_grad, flags, strict=True):
                if z and id(p) in trained:
                    self._zero_run[id(p)] = self._zero_run.get(id(p), 0) + 1
                    if self._zero_run[id(p)] >= self.patience:
                        zero.append(p)
                else:
                    self._zero_run.pop(id(p), None)
                    self._alive.add(id(p))
        none = [p for p in missing if self._due(p, step)]
        zero = [p for p in zero if self._due(p, step)]
        if zero or none:
            self.pending = {"zero": zero, "none": none, "all_zero": False}
        return total

    def _due(self, p: torch.Tensor, step: int) -> bool:
        if id(p) in self._fired or (self.ignore and any(i in self.name(p) for i in self.ignore)):
            return False
        ex = self._excused.get(id(p))
        return ex is None or step >= ex[0]

    def _note_names(self, model: nn.Module) -> None:
        if len(self._names) < sum(1 for _ in model.parameters()):
            self._names = {}
            for n, p in model.named_parameters(remove_duplicate=False):
                self._names.setdefault(id(p), n)

    def name(self, p: torch.Tensor) -> str:
        return self._names.get(id(p), f"<parameter {tuple(p.shape)}>")

    # ------------------------------------------------------------------ frozen by mistake (first check only)

    def frozen(self, model: nn.Module) -> tuple[list[str], list[str]]:
        """(frozen parameters tied to a trained module's weights, other frozen parameters beside trained ones);
        computed once per guard."""
        if self._frozen_checked:
            return [], []
        self._frozen_checked = True
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        trains = {}
        for mname, mod in model.named_modules(remove_duplicate=False):
            own = list(mod._parameters.items())
            trains[mname] = [(n, p) for n, p in own if p is not None]
        tied, beside = [], []
        seen: set[int] = set()
        for mname, own in trains.items():
            if not any(p.requires_grad for _, p in own):
                continue
            for n, p in own:
                if p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                full = f"{mname}.{n}" if mname else n
                (tied if len(names.get(id(p), ())) > 1 else beside).append(full)
        return tied, beside

    # ------------------------------------------------------------------ the expensive part, on suspicion

    def reaching(self, watch: ReachWatch, loss: torch.Tensor | None, suspects: list[torch.Tensor]) -> set[int] | None:
        """The ids of the suspects whose value reached the loss in the re-run `watch` saw (None: no loss)."""
        if not isinstance(loss, torch.Tensor):
            return None
        mask = watch.of.get(id(loss), 0)
        return {id(p) for i, p in enumerate(suspects) if mask >> i & 1}

    def settle(self, pending: dict, reached: set[int] | None, step: int) -> list[dict]:
        """The dead parameters to report (marked fired), the unused ones excused for a while."""
        dead = []
        for state in ("none", "zero"):
            for p in pending[state]:
                if reached is None or id(p) not in reached:  # unused (or no program to tell): excused a while
                    _, times = self._excused.get(id(p), (0, 0))
                    self._excused[id(p)] = (step + 2 ** min(times + 1, 10), times + 1)
                    continue
                self._fired.add(id(p))
                dead.append({"name": self.name(p), "gradient": state, "had_gradient": id(p) in self._alive,
                             "zero_steps": self._zero_run.get(id(p)) if state == "zero" else None})
        return dead


def check(fw: FlowWatch, guard: Any) -> tuple[Trigger, dict] | None:
    """(trigger, the snapshot's `gradient_flow`) when this step's suspects reach the loss; None otherwise."""
    pending, fw.pending = fw.pending, None
    tied, beside = fw.frozen(guard.model)
    if not pending and not tied:
        return None
    suspects = (pending["none"] + pending["zero"]) if pending else []
    reached: set[int] | None = set()
    reentrant, ckpt = False, None
    if suspects:
        dist = torch.distributed
        if not guard._states or not guard.export or (dist.is_available() and dist.is_initialized()):
            # (distributed: the re-run's forward may hold collectives this rank alone would start)
            return None
        st = guard._as_called(guard._states[-1])
        forward, loss = guard._forward_loss(st)
        watch, seen = ReachWatch(suspects), {}
        with guard._calls_paused():  # the guard's own re-run, on state it owns (as a snapshot's recording)
            snapshot.record(guard.model, st, forward, loss, guard._autocast or None, watch=watch, seen=seen)
        reached = fw.reaching(watch, seen.pop("loss", None), suspects)
        reentrant, ckpt = watch.reentrant, watch.checkpoint_call
        del watch, seen
    dead = fw.settle(pending, reached, guard.step_index) if pending else []
    dead += [{"name": n, "gradient": "frozen", "had_gradient": False, "zero_steps": None} for n in tied]
    if not dead:
        return None
    trigger = Trigger.GRADIENT_DIED if any(d["had_gradient"] for d in dead) else Trigger.NO_GRADIENT
    return trigger, {"dead": dead, "frozen": beside, "all_zero": bool(pending and pending.get("all_zero")),
                     "reentrant_checkpoint": reentrant, **(ckpt or {})}


SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
                         "new_full", "rand_like", "randn_like", "randint_like", "_shape_as_tensor", "sym_size",
                         "sym_numel", "sym_stride", "sym_storage_offset"})  # read only the input's shape


class ReachWatch:
    """Told every op of the guard's re-run (`snapshot.record(watch=...)`): which suspects' values each tensor was
    computed from. Not an edge: a tensor with no elements, an op that reads only a shape, the values of an
    `index_put` whose boolean mask selects nothing (an embedding row for a token not in the batch). A tensor that
    shares a suspect's storage without coming from an op (`.data`) counts as the suspect."""

    def __init__(self, suspects: list[torch.Tensor]):
        self.of: dict[int, int] = {id(p): 1 << i for i, p in enumerate(suspects)}
        self.reentrant = False  # an op ran under no_grad inside a reentrant checkpoint's forward
        self.checkpoint_call: dict | None = None  # the lines that called that checkpoint (_reentrant_call)
        self._looked = 0
        self._keep: dict[int, torch.Tensor] = {}  # the tensors `of` names stay alive: their ids are not reused
        self._ptrs = {}
        for i, p in enumerate(suspects):
            try:
                self._ptrs[p.untyped_storage().data_ptr()] = 1 << i
            except Exception:  # noqa: BLE001, S112 - a tensor without storage (meta, subclass): identity only
                continue

    def see(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        if not torch.is_grad_enabled() and not self.reentrant and self._looked < 20:
            self._looked += 1
            self.checkpoint_call = _reentrant_call()
            self.reentrant = self.checkpoint_call is not None
        try:
            name = func.overloadpacket.__name__
        except AttributeError:
            return
        if name in SHAPE_ONLY:
            return
        read: list[Any] = list(args) + list(kwargs.values())
        if name.startswith("index_put") and len(args) > 2 and _selects_nothing(args[1]):
            read = [args[0]]
        mask = 0
        for t in _tensors(read):
            if t.numel() == 0:
                continue
            m = self.of.get(id(t))
            if m is None and self._ptrs:
                try:
                    m = self._ptrs.get(t.untyped_storage().data_ptr())
                except Exception:  # noqa: BLE001
                    m = None
            mask |= m or 0
        if mask:
            for o in _tensors([out]):
                self.of[id(o)] = self.of.get(id(o), 0) | mask
                self._keep[id(o)] = o


def _reentrant_call() -> dict | None:
    """When the running op was called from torch.utils.checkpoint's reentrant CheckpointFunction.forward: the
    first line outside torch above it (the checkpoint call: `checkpoint(block, x, use_reentrant=True)`, or
    transformers' checkpointing layer wrapper) and the line that called that one (the layer call in the model's
    forward), as `checkpoint_call` / `checkpoint_caller` frames; None otherwise."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "forward" and f.f_code.co_filename.replace("\\", "/").endswith("utils/checkpoint.py"):
            found = user_frames_from(f.f_back, 2)
            names = ("checkpoint_call", "checkpoint_caller")
            return {k: {"file": fr[0], "line": fr[1], "function": fr[2], "code": fr[3]}
                    for k, fr in zip(names, found, strict=False)}
        f = f.f_back
    return None


def _selects_nothing(indices: Any) -> bool:
    masks = [t for t in _tensors([indices]) if t.dtype == torch.bool]
    return bool(masks) and any(not bool(t.any()) for t in masks)


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for e in v for t in _tensors(e)]
    return []
