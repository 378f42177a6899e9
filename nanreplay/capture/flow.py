"""Gradients that stop flowing: the guard's triggers `no_gradient`, `gradient_died`, `gradient_vanished` (docs/flow.md).

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
  B = 0 or adaLN-zero give exact zeros on the first step only) unless it is *inert* (`inert_of`: the loss does
  not depend on its value — a softmax over one element, a cancelling subtraction or normalisation, a weight on a
  zero state): then one warning line, no snapshot (`inert=True` makes it one);
* a step whose every gradient is exactly zero is counted (`all_zero_count`); a run of them is tested like any
  zero: inert (a GRPO group whose rewards are all equal has zero advantage) is one warning for the run, not
  inert (a saturated output) fires; `all_zero_steps=N` makes N of them in a row fire regardless;
* a module whose share of the gradient norm collapses (capture/vanish.py): `gradient_vanished`;
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
from nanreplay.capture import vanish as vanish_mod
from nanreplay.enums import Trigger
from nanreplay.replay.frames import user_frames_from

log = logging.getLogger("nanreplay")

PATIENCE = 3  # consecutive steps of an exactly-zero gradient before it fires


class FlowWatch:
    """The guard's memory of which trained parameters had gradients, and the checks on each step."""

    def __init__(self, patience: int = PATIENCE, all_zero_steps: int | None = None, ignore: tuple | list = (),
                 inert: bool = False, vanish: float | None = vanish_mod.FACTOR, vanish_window: int = vanish_mod.WINDOW,
                 vanish_floor: float | None = vanish_mod.FLOOR):
        self.patience = max(1, int(patience))
        # None: no vanishing trigger; vanish_floor None: no floor from the start
        self.vanish = vanish_mod.VanishWatch(vanish, vanish_window, floor=vanish_floor) if vanish else None
        self.all_zero_steps = max(1, int(all_zero_steps)) if all_zero_steps else None  # None: never a snapshot
        self.fire_inert = bool(inert)  # True: inert parameters write snapshots too (they never learn)
        self.ignore = tuple(str(i) for i in ignore)  # parameter names containing one of these are never reported
        self._names: dict[int, str] = {}
        self._alive: set[int] = set()  # params that ever had a non-zero gradient
        self._alive_count = -1  # the number of gradients on the last healthy step whose params were all noted
        self._zero_run: dict[int, int] = {}  # consecutive zero-gradient steps per param
        self._all_zero_run = 0
        self._excused: dict[int, tuple[int, int]] = {}  # id -> (checked again at this step, times found unused)
        self._fired: set[int] = set()
        self._frozen_checked = False
        self.all_zero_count = 0  # steps on which every gradient was exactly zero
        self.inert: dict[str, int] = {}  # parameter -> the step its zero gradient was found inert (warned once)
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
        norms = torch.stack(ti.foreach_norm([p.grad.detach() for p in with_grad]))  # (float32)
        total_t = torch.linalg.vector_norm(norms)
        got = torch.cat([total_t.reshape(1), norms]).tolist()  # one host sync: the total and every norm
        total_f, norm_list = got[0], got[1:]
        total, nz = (total_f if want_norm else None), norm_list.count(0.0)
        if self.vanish is not None:  # (host arithmetic on the numbers read back; no tensor op)
            collapsed = self.vanish.observe(with_grad, norm_list, total_f,
                                            lambda: self._note_names(model) or self._names)
            if collapsed is not None and nz < len(with_grad):
                self.vanish.seen(collapsed, total_f)
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
        all_zero = bool(nz) and nz == len(with_grad)  # every gradient exactly zero (zero advantage, or all dead)
        if all_zero:
            self.all_zero_count += 1
            self._all_zero_run += 1
            if self.all_zero_steps and self._all_zero_run >= self.all_zero_steps:  # asked for: fires as it is
                self._all_zero_run = 0
                dead = [p for p in with_grad if id(p) not in self._fired and id(p) in trained]
                if dead:
                    self.pending = {"zero": dead, "none": [], "all_zero": True, "forced": True}
                    return total
        else:
            self._all_zero_run = 0
        zero: list[torch.Tensor] = []
        if nz:
            for p, n in zip(with_grad, norm_list, strict=True):
                if n == 0 and id(p) in trained:
                    self._zero_run[id(p)] = self._zero_run.get(id(p), 0) + 1
                    if self._zero_run[id(p)] >= self.patience:
                        zero.append(p)
                else:
                    self._zero_run.pop(id(p), None)
                    self._alive.add(id(p))
        none = [p for p in missing if self._due(p, step)]
        zero = [p for p in zero if self._due(p, step)]
        if zero or none:
            self.pending = {"zero": zero, "none": none, "all_zero": all_zero}
        return total

    def _due(self, p: torch.Tensor, step: int) -> bool:
        if id(p) in self._fired or (self.ignore and any(i in self.name(p) for i in self.ignore)):
            return False
        ex = self._excused.get(id(p))
        return ex is None or step >= ex[0]

    def _excuse(self, p: torch.Tensor, step: int) -> None:
        """Not reported now; checked again after 2, 4, 8, ... (at most 1024) steps."""
        _, times = self._excused.get(id(p), (0, 0))
        self._excused[id(p)] = (step + 2 ** min(times + 1, 10), times + 1)

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

    def settle(self, pending: dict, reached: set[int] | None, step: int, inert: set[int] = frozenset()) -> list[dict]:
        """The dead parameters to report (marked fired); the unused and the inert ones excused for a while."""
        dead = []
        for state in ("none", "zero"):
            for p in pending[state]:
                if reached is None or id(p) not in reached or id(p) in inert:
                    # unused (or no program to tell), or inert: the loss does not depend on its value
                    self._excuse(p, step)
                    if id(p) in inert and not pending.get("all_zero"):  # (an all-zero step is the batch's)
                        self.inert.setdefault(self.name(p), step)
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
        vanished = fw.vanish.pending if fw.vanish is not None else None
        if vanished:
            fw.vanish.pending = None
            return Trigger.GRADIENT_VANISHED, {"dead": [], "vanished": vanished, "frozen": beside, "all_zero": False,
                                               "reentrant_checkpoint": False}
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
    inert: set[int] = set()
    zero = [p for p in (pending or {}).get("zero", ()) if reached is not None and id(p) in reached]
    if zero and not pending.get("forced") and not fw.fire_inert:
        inert = inert_of(fw, guard, zero)
        _warn_inert(fw, guard, [p for p in zero if id(p) in inert], pending)
    dead = fw.settle(pending, reached, guard.step_index, inert) if pending else []
    dead += [{"name": n, "gradient": "frozen", "had_gradient": False, "zero_steps": None} for n in tied]
    if not dead:
        return None
    trigger = Trigger.GRADIENT_DIED if any(d["had_gradient"] for d in dead) else Trigger.NO_GRADIENT
    return trigger, {"dead": dead, "frozen": beside, "all_zero": bool(pending and pending.get("all_zero")),
                     "reentrant_checkpoint": reentrant, **(ckpt or {})}


BAND = 1e-3  # a moved gradient whose first-order loss change is below this share of the loss may be rounding
REL = 1e-5  # ... and is when putting that suspect back changes the loss by less than this share of it
CONFIRM = 16  # at most this many such suspects confirmed one by one (a forward each); the rest are not inert


def inert_of(fw: FlowWatch, guard: Any, suspects: list[torch.Tensor]) -> set[int]:
    """The ids of the suspects (exactly-zero gradients, values reaching the loss) whose gradient stays zero when the
    step is run again with fresh random values in their place (normal, at their own scale up to 1: small enough to
    leave any saturation or dead region their values are in): the loss does not depend on them on
    this batch (a softmax over one element, a bias that a subtraction or a normalisation cancels, a weight that
    multiplies a zero state, a batch whose advantages are all zero). One forward and backward, on state the guard
    owns; the suspects are replaced by moved copies for the call (`torch.func.functional_call`), never written.
    A suspect that is zero only at its values (a dead ReLU, a saturated sigmoid: the move revives it) is not
    inert. A moved gradient that is not exactly zero but small (rounding in a cancelling normalisation: first-order
    loss change below BAND of the loss) is confirmed by a forward with that suspect put back to its own values (the
    others fresh): inert if the loss moves by less than REL of itself. A gradient zero at the moved values too is
    inert only where the value does not matter either: with those suspects put back the loss must not move by REL
    of itself (one forward; where it moves, each is put back alone, at most CONFIRM): `round`, `floor`, `sign` in
    the path give a zero derivative at every value, and a loss that still depends on the value in steps."""
    suspects = [p for p in suspects if id(p) in fw._names]  # (a parameter outside the model cannot be swapped)
    gen = torch.Generator().manual_seed(0)  # its own generator: the training's RNG is never drawn from
    moved, deltas = {}, []
    for p in suspects:
        d = p.detach()
        scale = float(d.float().pow(2).mean().sqrt()) if d.numel() else 0.0
        scale = min(scale, 1.0) if 0.0 < scale < float("inf") else 1.0
        fresh = (torch.randn(d.shape, generator=gen) * scale).to(d.device, d.dtype)  # out of any saturation
        deltas.append(fresh - d)
        moved[fw.name(p)] = fresh.requires_grad_()
    if not suspects:
        return set()
    value = _loss_with(guard, moved)
    if not isinstance(value, torch.Tensor) or not value.requires_grad:  # the swap did not take (a cached reference)
        return set()
    grads = torch.autograd.grad(value.float().sum(), list(moved.values()), allow_unused=True)
    scale = abs(float(value.detach().float().sum()))
    if scale != scale or scale == float("inf"):  # moved too far to tell: not called inert
        return set()
    out, unsure = set(), []
    for p, g, delta in zip(suspects, grads, deltas, strict=True):
        if g is None:  # the moved copy was not used: the swap did not reach this use; cannot tell
            continue
        if not bool(g.any()):
            out.add(id(p))
        elif float((g.float() * delta.float()).abs().sum()) <= BAND * scale:
            unsure.append(p)
    fresh = {n: t.detach() for n, t in moved.items()}
    with torch.no_grad():
        if out:  # zero at any value is inert only if the value does not matter: round()/floor() make a loss
            zero = [p for p in suspects if id(p) in out]  # that moves with it in steps, with a zero derivative
            back = float(_loss_with(guard, {**fresh, **{fw.name(p): p.detach() for p in zero}}).float().sum())
            if not abs(back - scale) <= REL * scale:  # (NaN too) some of them matter: which, one forward each
                out -= {id(p) for p in zero[CONFIRM:]}
                for p in zero[:CONFIRM]:
                    one = float(_loss_with(guard, {**fresh, fw.name(p): p.detach()}).float().sum())
                    if not abs(one - scale) <= REL * scale:
                        out.discard(id(p))
        for p in unsure[:CONFIRM]:
            back = float(_loss_with(guard, {**fresh, fw.name(p): p.detach()}).float().sum())
            if abs(back - scale) <= REL * scale:
                out.add(id(p))
    return out


def _loss_with(guard: Any, params: dict[str, torch.Tensor]) -> Any:
    """The step's loss run again from its begin() state (guard-owned state, a fresh copy of the batch) with these
    parameters in place of the model's own for the call."""
    st = snapshot.rerun_copy(guard._as_called(guard._states[-1]))
    forward, loss = guard._forward_loss(st)
    step = _Step(guard.model, lambda: loss(forward()))
    with guard._calls_paused(), snapshot.from_begin_state(guard.model, st, guard._autocast or None):
        return torch.func.functional_call(step, {f"model.{n}": t for n, t in params.items()}, (), strict=False)


class _Step(nn.Module):
    """The step as a module whose only child is the model, for `functional_call` with moved parameters."""

    def __init__(self, model: nn.Module, run: Any):
        super().__init__()
        self.model = model
        self._run = run

    def forward(self) -> Any:
        return self._run()


def _warn_inert(fw: FlowWatch, guard: Any, params: list[torch.Tensor], pending: dict) -> None:
    new = [fw.name(p) for p in params if fw.name(p) not in fw.inert]
    if pending.get("all_zero") and len(params) == len(pending["zero"]):
        guard._warn_once("flow-all-zero", f"every gradient was exactly zero on {fw.all_zero_count} step(s) "
                                          f"so far (step {guard.step_index}): the loss does not depend on the "
                                          "parameters on those batches (a GRPO group whose rewards are all equal has "
                                          "zero advantage); no snapshot. check_flow={'all_zero_steps': N} makes N "
                                          "such steps in a row write one")
    elif new:
        shown = ", ".join(new[:6]) + (f" and {len(new) - 6} more" if len(new) > 6 else "")
        guard._warn_once(f"flow-inert:{new[0]}", f"gradient exactly zero at step {guard.step_index} and the loss does "
                                                 f"not depend on the value of {shown} (a softmax over one element, a "
                                                 "cancelling subtraction or normalisation, a zero state): it cannot "
                                                 "learn; no snapshot. check_flow={'inert': True} writes one, "
                                                 "{'ignore': [name]} silences this")


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
