"""What a trainer integration does when its guard finds a non-finite step: stop training with an exception
that says where the snapshot is and how to analyze it, or skip the optimizer step and go on.

Shared by `nanreplay.lightning`, `nanreplay.transformers` and `nanreplay.accelerate`; imports only torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nanreplay.enums import Trigger
from nanreplay.errors import GuardError, TrainingStopped

ACTIONS = ("raise", "skip")
_SAID = {Trigger.LOSS: "non-finite loss", Trigger.GRADIENT: "non-finite gradient",
         Trigger.GRAD_NORM_OVERFLOW: "gradient norm overflowed float32", Trigger.UPDATE: "non-finite weights"}


def check_action(action: str) -> str:
    if action not in ACTIONS:
        raise GuardError(f"on_nonfinite must be 'raise' (stop training, the default) or 'skip' (skip the optimizer "
                         f"step and go on), not {action!r}")
    return action


def guard_options(options: dict[str, Any], taken: Iterable[str], who: str) -> dict[str, Any]:
    """The NanGuard options a user passed through an integration; those the integration sets itself are refused."""
    clash = sorted(set(options) & set(taken))
    if clash:
        raise GuardError(f"{who} sets {', '.join(clash)} itself; pass the other NanGuard options only")
    return dict(options)


def stopped(guard: Any, skip_hint: str) -> TrainingStopped:
    """The exception that stops training: what happened, at which step, where the snapshot is."""
    trigger = guard.last_trigger or Trigger.GRADIENT
    micro = f" (micro-batch {guard.micro_batch})" if trigger == Trigger.LOSS and guard.micro_batch is not None else ""
    path = guard.last_snapshot
    if path:
        tail = f"snapshot: {path} - analyze it anywhere, without the training code: nanreplay analyze {path}"
    else:
        tail = f"no snapshot was written ({guard.last_error or 'see the warning above'})"
    msg = (f"nanreplay: {_SAID.get(trigger, f'non-finite {trigger}')} at step {guard.step_index}{micro}; training "
           f"stopped before the optimizer applied it; {tail}. To skip such steps instead: {skip_hint}")
    return TrainingStopped(trigger, path, msg)


def drop_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Skip the coming optimizer step: parameters without a gradient are left alone by every torch optimizer."""
    for p in params:
        p.grad = None
