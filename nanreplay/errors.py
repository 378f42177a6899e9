"""nanreplay's one error hierarchy.

The CLI turns a `NanReplayError` into one line and its `exit_code`; anything else
that escapes is a bug in nanreplay and keeps its traceback.

    NanReplayError                 exit 1
    ├── UsageError                 exit 2: the input or the invocation cannot work
    │   ├── SnapshotError          the file is not a readable, valid snapshot
    │   │   └── ConfinedCrash      its step crashed torch's kernel in the confined child (a signal)
    │   ├── TrustError             the snapshot names code and --trust was not given
    │   ├── ModelError             the model / loss / state cannot be rebuilt for this snapshot
    │   ├── OutputError            an output path that must not or cannot be written
    │   └── LimitError             the snapshot needs more memory than --max-memory allows
    ├── ReplayError                exit 1: the inputs were fine, the replay itself failed
    ├── TimeLimitError             exit 1: the analysis ran past --timeout
    ├── GuardError                 training side: the guard was used in a way that cannot work
    ├── NonFiniteStep              training side: raised by NanGuard(on_nonfinite="raise")
    │   └── TrainingStopped        a trainer integration stopped training (Lightning, HF Trainer)
    └── PoolError                  triage: the worker pool itself failed
"""

from __future__ import annotations

import re


class NanReplayError(Exception):
    """Base class: the message is the whole story, shown as one line."""

    exit_code = 1


class UsageError(NanReplayError):
    """The user asked for something that cannot work (bad file, bad spec, ...)."""

    exit_code = 2


class SnapshotError(UsageError):
    """The file cannot be read as a snapshot: missing, corrupt, hostile, or outside the format's schema."""


class ConfinedCrash(SnapshotError):
    """The snapshot's step killed the confined child with a signal (SIGSEGV, SIGFPE, ...) inside a torch kernel."""


class TrustError(UsageError):
    """The snapshot names code, and the user has not said to run it."""


class ModelError(UsageError):
    """The snapshot was read, but its step cannot be rebuilt (no model for it, a state that does not fit)."""


class OutputError(UsageError):
    """An output path that nanreplay must not or cannot write."""


class LimitError(UsageError):
    """The snapshot would need more memory than the limit allows (`--max-memory`); the message names the flag."""


class ReplayError(NanReplayError):
    """The inputs were fine but the replay itself failed."""

    exit_code = 1


class TimeLimitError(NanReplayError):
    """The analysis ran past its time limit (`--timeout`)."""

    exit_code = 1


AnalysisError = ReplayError  # the name used before 0.2; kept for scripts that catch it


class GuardError(NanReplayError, ValueError):
    """NanGuard was used in a way that cannot work (e.g. step() without an optimizer)."""


class NonFiniteStep(NanReplayError, RuntimeError):
    """Raised by a guard built with on_nonfinite="raise"."""

    def __init__(self, trigger: str, snapshot: str | None, what: str | None = None):
        where = f"; snapshot: {snapshot}" if snapshot else "; no snapshot was written"
        super().__init__(f"{what or f'non-finite {trigger}'} at this step{where}")
        self.trigger, self.snapshot = str(trigger), snapshot


class TrainingStopped(NonFiniteStep):
    """A trainer integration (Lightning, Hugging Face Trainer) stopped training before a non-finite update."""

    def __init__(self, trigger: str, snapshot: str | None, message: str):
        super().__init__(trigger, snapshot)
        self.args = (message,)


class PoolError(NanReplayError, RuntimeError):
    """The worker pool could not start or lost all its workers."""


def first_line(e: BaseException | str, limit: int = 200) -> str:
    """The first line of an exception's message (or any text): what a one-line error can carry. A line cut at
    `limit` ends at a word, with an ellipsis: a message never seems to end mid-sentence."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) <= limit:
        return line
    cut = line[:limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" ,;:") + "…"


def first_sentences(e: BaseException | str, limit: int = 200) -> str:
    """The whole sentences of a message's first line that fit in `limit` (at least the first, cut as
    `first_line` cuts): for quoting a library's long explanation in a line that must end cleanly."""
    line = first_line(e, 10_000)
    parts = re.split(r"(?<=[.!?])\s+", line)
    out = parts[0]
    for p in parts[1:]:
        if len(out) + 1 + len(p) > limit:
            break
        out = f"{out} {p}"
    return first_line(out, limit)


def kernel_message(e: BaseException | str) -> str:
    """The first line of a kernel's message with its numbers taken out: a kernel given a crafted step program
    can quote memory in its message (`Index -4099 of input takes value 2322203970491129888`); what remains
    still says what went wrong (`Index # of input takes value # which is not in the valid range`)."""
    return _NUMBER.sub("#", first_line(e))


_NUMBER = re.compile(r"[-+]?(?:0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)")


def raised(e: BaseException) -> str:
    """`RuntimeError in aten.mkldnn_rnn_layer.default: <first line>`: the exception, the program op it came from
    where a step-program replay tagged it (`op_of`), and its first line (its numbers taken out for a program's
    op: `kernel_message`)."""
    op = getattr(e, "nanreplay_op", None)
    if isinstance(op, str):
        return f"{type(e).__name__} in {op}: {kernel_message(e)}"
    return f"{type(e).__name__}: {first_line(e)}"


def op_of(e: BaseException, op: str) -> None:
    """Tag an exception with the step-program op that raised it (first tag wins: the innermost op)."""
    if getattr(e, "nanreplay_op", None) is None:
        try:
            e.nanreplay_op = op  # type: ignore[attr-defined]
        except AttributeError:  # an exception type without __dict__: the message stays as it is
            pass
