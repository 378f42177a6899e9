"""What one instrumented replay records: per-op records, events, the failure, and the step.

Records hold summaries, never references to intermediate tensors (see docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanreplay.enums import Kind, Phase, Role
from nanreplay.replay.frames import Frame


@dataclass(slots=True)
class OpRecord:
    """One forward aten op: enough to attribute it and its backward node."""

    op: Any  # the OpOverload; stringified only when needed
    module: str
    frame: Frame | None
    call: int  # number of the user-level torch call that ran it (0: none)
    src: tuple  # per tensor argument: the forward op that produced it (None: a leaf or unknown)
    leaves: tuple | None = None  # per tensor argument: (kind, name) of a known leaf (batch tensor, parameter)
    node: int | None = None  # a step program's node that ran it (StepModule.current_node)


@dataclass(slots=True)
class Event:
    """An op whose floating output held a NaN or an Inf."""

    index: int
    phase: Phase  # the loss counts as forward
    op: str
    kind: Kind
    role: Role
    parents: tuple[int, ...]
    out: dict  # numel, nan, posinf, neginf
    fwd: int | None  # forward op record: the op itself, or the op whose gradient this is
    node: str | None = None  # autograd node running the op (backward)
    node_seq: int | None = None
    inputs: list[dict] | None = None  # input stats, for every event that can be a culprit
    scalars: list | None = None  # non-tensor arguments (exponents, eps, dims), same events
    frame: Frame | None = None  # backward only: the user's own line, when backward ran Python code
                                 # (a custom autograd.Function's backward, a tensor hook) ...
    call: int = 0  # ... and the number of the user-level call that ran it there


@dataclass
class Failure:
    """What broke the step: the loss, or (finite loss) a parameter gradient."""

    what: str  # "loss" | "gradient"
    name: str  # "loss" or the parameter name
    kind: str
    event: int | None  # the event that produced it


@dataclass
class Anomaly:
    """What torch.autograd.set_detect_anomaly(True) would have done."""

    raises: bool
    node: str | None = None
    node_seq: int | None = None
    output: int | None = None

    @property
    def message(self) -> str | None:
        if not self.raises:
            return None
        return f"Function '{self.node}' returned nan values in its {self.output}th output."


@dataclass
class Step:
    """The result of one instrumented replay."""

    loss: float | None
    events: list[Event]
    ops: list[OpRecord]
    op_by_seq: dict[int, int]
    failure: Failure | None
    anomaly: Anomaly | None
    grads: list[dict]  # per-parameter gradient statistics (the seed's walk)
    call_names: list[str] = field(default_factory=list)  # what each numbered call was (what a patch receives)
    user_calls: list[str | None] = field(default_factory=list)  # for a step program: the user's call it ran in
    internal_errors: list[str] = field(default_factory=list)
    backward_error: str | None = None
    activations: list[list] = field(default_factory=list)
    grad_shapes: list[list] = field(default_factory=list)

    def module_of(self, ev: Event) -> str | None:
        return self.ops[ev.fwd].module if ev.fwd is not None else None

    def frame_of(self, ev: Event) -> Frame | None:
        """The line to blame: where the op itself ran if that was user code, else its forward call."""
        return ev.frame or self.forward_frame_of(ev)

    def forward_frame_of(self, ev: Event) -> Frame | None:
        return self.ops[ev.fwd].frame if ev.fwd is not None else None

    def forward_op_of(self, ev: Event) -> str | None:
        return str(self.ops[ev.fwd].op) if ev.fwd is not None else None

    def user_call(self, call: int) -> str | None:
        """How the user spelled call `call` (`F.linear`, `Tensor.__pow__`), where it differs from what ran."""
        return self.user_calls[call] if 0 < call < len(self.user_calls) else None

    def call_of(self, ev: Event) -> int:
        if ev.frame is not None:
            return ev.call
        return self.ops[ev.fwd].call if ev.fwd is not None else 0


