"""The guard's re-runs run on state it owns (capture/owned.py): recording a step between the loop's forward and
its backward leaves every live tensor unwritten (values and version counters), the gradient objects, the RNG
streams and the optimizer state as they were, and the program still replays bitwise equal to eager.

Also: `loss_fn` given a tuple output (minGPT's `logits, _ = model(x)`), found on the first step by the element the
loop gave its loss.
"""

from __future__ import annotations

import random
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard, formats


class Counted(nn.Module):
    """BatchNorm (buffers written in place), a buffer seen under two names, a plain tensor attribute that forward
    writes in place (not a buffer), dropout (RNG)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4 * 6, 2)
        self.register_buffer("scale", torch.ones(4, 1))
        self.alias = self.scale  # the same buffer object under a plain attribute
        self.calls = torch.zeros(())  # a plain tensor attribute, written in place by forward
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        self.calls.add_(1)
        h = self.drop(F.relu(self.bn(self.conv(x)) * self.scale))
        return self.head(h.flatten(1))


def _step_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _live(model, opt):
    tensors = dict(model.named_parameters()) | dict(model.named_buffers()) | {"calls": model.calls}
    return {"versions": {n: t._version for n, t in tensors.items()},
            "values": {n: t.detach().clone() for n, t in tensors.items()},
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "grad_values": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "rng": (torch.get_rng_state(), random.getstate()),
            "opt": {k: {s: v.clone() for s, v in st.items()} for k, st in opt.state.items()}}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.reshape(-1).view(torch.uint8) if a.is_floating_point()
                                                           else a, b.reshape(-1).view(torch.uint8)
                                                           if b.is_floating_point() else b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_recording_between_forward_and_backward_writes_no_live_tensor(tmp_path):
    torch.manual_seed(0)
    model = Counted()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, step_fn=_step_fn, folder=tmp_path)
    for step in range(3):
        batch = (torch.randn(4, 3, 8), torch.randint(0, 2, (4,)))
        guard.begin(batch, step=step)
        loss = _step_fn(model, batch)
        assert guard.loss_ok(loss)  # the first step runs step_fn again: the check
        if step == 2:  # a snapshot recorded now, with the loop's graph still waiting for backward
            before = _live(model, opt)
            d = guard.to_dict("loss")
            after = _live(model, opt)
            assert before["versions"] == after["versions"]
            assert all(after["grads"][n] is g for n, g in before["grads"].items())  # the very gradient objects
            for key in ("values", "grad_values", "rng", "opt"):
                assert _equal(before[key], after[key]), key
            assert model.alias is model.scale
        loss.backward()  # no "modified by an inplace operation"
        assert guard.grads_ok()
        opt.step()
        opt.zero_grad()
    assert d["step_program"] is not None, d.get("program_error")
    assert model.calls.item() == 3  # the loop's three forwards; the guard's re-runs wrote into clones
    assert not torch.equal(d["state"]["bn.running_mean"], before["values"]["bn.running_mean"])  # as step 2 began
    path = tmp_path / "snap.pt"
    torch.save(d, path)
    snap = formats.load(str(path))
    subject = formats.rebuild(snap, model=None, loss=None, device="cpu", trust=False)
    subject.prepare()
    replayed = subject.loss(subject.forward())
    assert replayed.item() == d["loss_value"]  # the same computation replayed: bitwise the loop's loss


def _gated_step(model, batch):
    """sqrt((b^2 + 1) * gate): with gate 0 a finite loss whose gradient is inf * 0 = NaN."""
    x, y, gate = batch
    return F.cross_entropy(model(x), y) + torch.sqrt((model.head.bias.sum() ** 2 + 1) * gate)


def test_the_micro_batch_search_leaves_gradients_and_buffers_alone(tmp_path):
    torch.manual_seed(0)
    model = Counted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, step_fn=_gated_step, folder=tmp_path)
    for k in range(3):
        batch = (torch.randn(4, 3, 8), torch.randint(0, 2, (4,)), torch.tensor(0.0 if k == 1 else 1.0))
        guard.begin(batch, step=0, micro_batch=k)
        loss = _gated_step(model, batch) / 3
        assert guard.loss_ok(loss)
        loss.backward()
    before = _live(model, opt)
    ok = guard.grads_ok()
    after = _live(model, opt)
    assert not ok and guard.last_snapshot
    assert torch.load(guard.last_snapshot, weights_only=True)["micro_batch"] == 1
    assert before["versions"] == after["versions"]
    assert all(after["grads"][n] is g for n, g in before["grads"].items())
    for key in ("values", "grad_values", "rng"):
        assert _equal(before[key], after[key]), key


class TupleGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, idx):
        h = self.emb(idx)
        return {"hidden": h, "logits": self.head(h)}, None


def _gpt_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def test_loss_fn_on_a_tuple_output_records_the_element_the_loop_used(tmp_path):
    torch.manual_seed(0)
    model = TupleGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, loss_fn=_gpt_loss, folder=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x, y = torch.randint(0, 16, (2, 5)), torch.randint(0, 16, (2, 5))
            guard.begin(x, y, step=step)
            out, _ = model(x)
            loss = _gpt_loss(out["logits"], y)
            if step == 1:
                loss = loss * float("nan")
            if not guard.loss_ok(loss):
                break
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert not [w for w in caught if "nanreplay" in str(w.message)]  # the element was found: nothing to warn
    d = torch.load(guard.last_snapshot, weights_only=True)
    assert d["step_program"] is not None, d.get("program_error")
    assert d["loss_spec"]["kind"] == "callable"


def test_a_loss_no_element_gives_is_said_on_the_first_step(tmp_path):
    torch.manual_seed(0)
    model = TupleGPT()
    guard = NanGuard(model, None, loss_fn=_gpt_loss, folder=tmp_path)
    x, y = torch.randint(0, 16, (2, 5)), torch.randint(0, 16, (2, 5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.begin(x, y, step=0)
        out, _ = model(x)
        guard.loss_ok(_gpt_loss(out["logits"], y) * 3.7)  # not what loss_fn gives on any element
    said = [str(w.message) for w in caught if "nanreplay" in str(w.message)]
    assert len(said) == 1 and "loss_fn=_gpt_loss" in said[0], said


class ShiftsLabels(nn.Module):
    """FSMT's shift_tokens_right: the labels the loop passes are masked in place by forward."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(8, 4), nn.Linear(4, 8)

    def forward(self, labels):
        labels.masked_fill_(labels == -100, 1)
        return self.head(self.emb(labels))


def _shift_step(model, batch):
    logits = model(batch["labels"])
    return F.cross_entropy(logits.reshape(-1, 8), batch["labels"].reshape(-1))


def test_a_forward_that_writes_its_inputs_writes_the_guards_copy(tmp_path):
    torch.manual_seed(0)
    model = ShiftsLabels()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, step_fn=_shift_step, folder=tmp_path)
    labels = torch.tensor([[3, -100, 5], [-100, 2, 7]])
    batch = {"labels": labels}
    guard.begin(batch, step=0)
    loss = _shift_step(model, batch)
    version = labels._version
    assert guard.loss_ok(loss)  # the first step's check runs the step again: on a copy of the batch
    d = guard.to_dict("loss")
    assert labels._version == version and d["step_program"] is not None, d.get("program_error")
    loss.backward()  # the cross-entropy saved the labels: still at the version it saved
