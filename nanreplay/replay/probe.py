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
    def __init__(self, index: int, op: str, keep: bool = False, go_on: bool = False):
        super().__init__()
        self.index, self.op, self.keep, self.go_on = index, op, keep, go_on
        self.n = 0
        self.inputs: list[dict] | None = None
        self.call: tuple | None = None  # (func, args, kwargs) with tensors cloned, when asked to keep them
        self.seq: int | None = None  # the sequence number of the autograd node the op made (with go_on)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.n == self.index:
            self.n += 1
            if str(func) == self.op:  # the same op at the same place: the replay's record and this run agree
                self.inputs = [stats.tensor_stats(t) for t in _tensor_args(args, kwargs)]
                if self.keep:
                    self.call = (func, _detached(args), _detached(kwargs))
                self.seq = ti.sequence_nr() - 1  # the node an op creates takes the number just before it
            if not self.go_on or self.call is None:
                raise _Found
            return func(*args, **kwargs)
        self.n += 1
        return func(*args, **kwargs)


def _detached(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x)
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


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
    mode = _run_to(subject, index, op, keep=False)
    return mode.inputs if mode is not None else None


def forward_op_call(subject: Any, index: int, op: str) -> tuple | None:
    """(func, args, kwargs) of forward op number `index`, its tensors cloned, or None (as forward_op_inputs)."""
    mode = _run_to(subject, index, op, keep=True)
    return mode.call if mode is not None else None


def forward_op_grads(subject: Any, index: int, op: str) -> tuple[tuple, tuple | None] | None:
    """Forward op number `index` as `forward_op_call` gives it, and the gradients that reached its autograd node
    in backward (cloned; None per output that got none, and None in all where no gradient reached it): one
    forward and the backward down to that node. None as forward_op_call."""
    mode = _Count(index, op, keep=True, go_on=True)
    got: list = []

    def grab(grad_outputs):
        got.append(tuple(None if g is None else g.detach().clone() for g in grad_outputs))
        raise _Found

    buffers = [(b, b.detach().clone()) for b in subject.model.buffers()]
    try:
        with anomaly_off():
            if subject.prepare is not None:
                subject.prepare()
            with mode, autocast_from(subject.run_autocast):
                loss = subject.loss(subject.forward())
            if mode.call is None:
                return None
            node = next((n for n in ti.autograd_nodes(loss.grad_fn) if ti.node_sequence_nr(n) == mode.seq), None) \
                if loss.grad_fn is not None else None
            if node is None:
                return mode.call, None
            node.register_prehook(grab)
            try:
                ti.run_backward(loss)
            except _Found:
                pass
            return mode.call, got[0] if got else None
    except Exception:  # noqa: BLE001 - a second look that fails is no answer, never a crash
        return None
    finally:
        subject.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _run_to(subject: Any, index: int, op: str, keep: bool) -> _Count | None:
    """Run the forward of `subject` itself up to op `index`; its buffers (BatchNorm's running stats, which a
    forward in train mode updates) are put back as they were, so the analyzed step is left untouched."""
    mode = _Count(index, op, keep)
    buffers = [(b, b.detach().clone()) for b in subject.model.buffers()]
    try:
        with anomaly_off():  # grad mode as in the replay: some ops decompose differently without it
            if subject.prepare is not None:
                subject.prepare()
            with mode, autocast_from(subject.run_autocast):
                subject.loss(subject.forward())
    except _Found:
        return mode
    except Exception:  # noqa: BLE001 - a second look that fails is no answer, never a crash
        return None
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return None
