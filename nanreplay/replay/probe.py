"""One forward op's inputs, looked up after the replay: `forward_op_inputs()`.

The instrumented replay keeps summaries, and only for the ops that made NaN/Inf. For a
backward culprit the report also wants the inputs of the forward op whose gradient it
computed (the `x` of `sqrt(x)`, whose zeros made `1/(2·sqrt(x))` infinite). Rather than
paying for statistics on every forward op in the hot loop, this runs the forward once
more, counts aten ops exactly as the Recorder numbers them, summarises the inputs of the
one op asked for and stops right there: at most one forward pass, and only for backward
culprits.
"""

from __future__ import annotations

from typing import Any

import torch

from nanreplay import stats
from nanreplay import torch_internals as ti
from nanreplay.replay.run import anomaly_off, autocast_from


class _Found(BaseException):  # noqa: N818 - not an error: the op was reached (a BaseException, so user code lets it pass)
    pass


class _Count(ti.TorchDispatchMode):
    def __init__(self, index: int, op: str):
        super().__init__()
        self.index, self.op = index, op
        self.n = 0
        self.inputs: list[dict] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.n == self.index:
            if str(func) == self.op:  # the same op at the same place: the replay's record and this run agree
                self.inputs = [stats.tensor_stats(t) for t in _tensor_args(args, kwargs)]
            raise _Found
        self.n += 1
        return func(*args, **kwargs)


def _tensor_args(args: tuple, kwargs: dict):
    """The tensor arguments in the order the Recorder lists them: positional, then keyword, lists flattened."""
    for a in list(args) + list(kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                yield t


def forward_op_inputs(subject: Any, index: int, op: str) -> list[dict] | None:
    """Statistics of the tensor inputs of forward op number `index` (an `OpRecord` index), or None.

    None when the forward does not reach that op, or reaches a different one there (a model
    whose ops depend on something the replay does not restore): never a wrong answer.
    """
    mode = _Count(index, op)
    try:
        with anomaly_off():  # grad mode as in the replay: some ops decompose differently without it
            if subject.prepare is not None:
                subject.prepare()
            with mode, autocast_from(subject.autocast):
                subject.loss(subject.forward())
    except _Found:
        return mode.inputs
    except Exception:  # noqa: BLE001 - a second look that fails is no answer, never a crash
        return None
    return None
