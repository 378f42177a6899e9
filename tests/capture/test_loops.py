"""NanGuard in real training loops (CPU, seconds each): the snapshot of the step that broke, every time.

Spikes do not starve the real failure; a GradScaler's routine back-off never fires; `step()` with a scaler
survives a failure; gradient accumulation snapshots the micro-batch that broke; a step that cannot be
recorded warns once (also under -W error) and never prints graphs; `step_fn` losses travel; the recorded
loss is the real (unscaled) loss; ranks agree on the step to snapshot.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.analysis import analyze

ROOT = Path(__file__).resolve().parents[2]


class PairNet(nn.Module):
    """A distance between two embeddings: sqrt at zero when a pair is duplicated (finite loss, Inf gradient)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, a, b):
        return ((self.enc(a) - self.enc(b)) ** 2).sum(-1).sqrt().mean()  # LINE: pair


def _pair_batch(g: torch.Generator, bad: bool):
    a = torch.randn(8, 6, generator=g)
    b = a + 0.3 * torch.randn(8, 6, generator=g)
    if bad:
        b[2] = a[2]  # a duplicated pair: distance exactly 0, gradient of sqrt at 0 is Inf
    return a, b


def test_spikes_do_not_use_up_the_failure_snapshot(tmp_path, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, spike_factor=10.0)
    g = torch.Generator().manual_seed(0)
    caplog.set_level(logging.WARNING, logger="nanreplay")
    failed_at = None
    for step in range(30):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if step in (12, 14, 16, 18):
            x = x * 1e3  # four finite spikes
        if step == 23:
            x[0, 0] = float("nan")
        guard.begin(x, y, step=step)
        if not guard.step(F.mse_loss(model(x), y), clip=1.0):  # clipped: the spikes stay spikes
            failed_at = step
            break
    assert failed_at == 23 and guard.last_snapshot and "nan_step000023_loss" in guard.last_snapshot
    assert len(guard.spike_snapshots) == 2 and all("grad_spike" in p for p in guard.spike_snapshots)
    spike_lines = [r.getMessage() for r in caplog.records if "_grad_spike_" in r.getMessage() and "written to" in r.getMessage()]
    assert spike_lines and all("gradient-norm spike (finite)" in m and "non-finite" not in m for m in spike_lines)


def _amp_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def test_healthy_fp16_run_with_a_grad_scaler_writes_nothing(tmp_path):
    """The scaler starts far too high on purpose: its first steps overflow and back off. None is a failure."""
    model = _amp_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, scaler=scaler)
    g = torch.Generator().manual_seed(0)
    for step in range(25):
        x, y = torch.randn(16, 16, generator=g), torch.randn(16, 1, generator=g)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        assert guard.loss_ok(loss)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        assert guard.grads_ok()
        scaler.step(opt)
        scaler.update()
    assert not list(tmp_path.glob("*.pt")) and guard.last_snapshot is None
    overflows = [h for h in guard.history if h.get("overflow")]
    assert overflows and scaler.get_scale() < 2.0**40  # it did back off, one history row per step
    assert [h["step"] for h in guard.history] == list(range(25))


def test_step_with_a_scaler_survives_a_failure_and_records_the_unscaled_loss(tmp_path):
    model = PairNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**6)  # scale 1: an overflow is real
    guard = NanGuard(model, opt, folder=tmp_path, scaler=scaler)
    g = torch.Generator().manual_seed(0)
    results = []
    for step in range(6):
        a, b = _pair_batch(g, bad=step == 3)
        guard.begin((a, b), step=step)
        opt.zero_grad()
        results.append(guard.step(model(a, b)))  # the step after the failure must work: scaler.update() ran
    assert results == [True, True, True, False, True, True]
    d = torch.load(guard.last_snapshot, weights_only=True)
    assert d["trigger"] == "gradient" and d["step"] == 3 and d["grad_scale"] == 1.0
    res = analyze(guard.last_snapshot, verify=False).to_json()
    assert res["verdict"] == "culprit_found" and res["culprit"]["backward_node"] == "SqrtBackward0"
    assert res["loss"] == pytest.approx(d["loss_value"])


def test_the_recorded_loss_is_the_real_loss_under_a_large_scale(tmp_path):
    model = _amp_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, scaler=scaler)
    x, y = torch.randn(4, 16), torch.randn(4, 1)
    x[0, 0] = float("inf")
    guard.begin(x, y, step=0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    assert not guard.loss_ok(loss)
    d = torch.load(guard.last_snapshot, weights_only=True)
    assert d["grad_scale"] == 4096.0 and str(d["history"][-1]["loss"]) == str(d["loss_value"]) == "nan"


@pytest.mark.parametrize("check_every_micro_batch", [True, False])
def test_accumulation_snapshots_the_micro_batch_that_broke(tmp_path, check_every_micro_batch):
    model = PairNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, folder=tmp_path)
    g = torch.Generator().manual_seed(0)
    accum, failed, bad_batch = 4, None, None
    for step in range(4):
        opt.zero_grad()
        for k in range(accum):
            a, b = _pair_batch(g, bad=(step, k) == (2, 1))  # the second micro-batch of step 2 is bad
            if (step, k) == (2, 1):
                bad_batch = (a, b)
            guard.begin((a, b), step=step, micro_batch=k)
            loss = model(a, b) / accum
            assert guard.loss_ok(loss)  # the loss stays finite: only the gradient breaks
            loss.backward()
            if (check_every_micro_batch or k == accum - 1) and not guard.grads_ok():
                failed = (step, k)
                break
        if failed:
            break
        opt.step()
    assert failed == ((2, 1) if check_every_micro_batch else (2, 3))
    d = torch.load(guard.last_snapshot, weights_only=True)
    assert d["step"] == 2 and d["micro_batch"] == 1 and d["trigger"] == "gradient"
    assert torch.equal(d["batch"]["inputs"][1], bad_batch[1])
    rows = [h["step"] for h in d["history"]]
    assert rows == [0, 1, 2]  # one history row per optimizer step, not per micro-batch
    assert "_micro1_" in Path(guard.last_snapshot).name
    res = analyze(guard.last_snapshot, verify=False).to_json()  # the snapshot reproduces the failure
    assert res["verdict"] == "culprit_found" and res["culprit"]["backward_node"] == "SqrtBackward0"
    assert all(p.grad is None or p.grad.shape == p.shape for p in model.parameters())  # gradients left in place


class SafeInv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp_min(1e-3).reciprocal()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return -g / (x * x)


class CustomNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return SafeInv.apply(self.fc(x)).log().mean()


def test_unrecordable_step_warns_once_and_never_raises_under_w_error(tmp_path, capfd):
    torch.manual_seed(0)
    model = CustomNet()
    guard = NanGuard(model, folder=tmp_path / "snaps")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -W error: a warning would be an exception
        for step in range(2):
            x = torch.full((3, 4), float("nan"))
            guard.begin(x, step=step)
            assert guard.loss_ok(model(x)) is False  # no exception
    assert len(guard.snapshots) == 2 and "SafeInv" in (guard.last_error or "")
    out, err = capfd.readouterr()
    assert "graph" not in (out + err).lower() and "def forward" not in out + err


def test_write_failures_and_the_cap_never_raise_under_w_error(tmp_path):
    model = nn.Linear(4, 1)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    guard = NanGuard(model, folder=ro / "sub", max_snapshots=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step in range(3):
                x = torch.full((2, 4), float("nan"))
                guard.begin(x, step=step)
                assert guard.loss_ok(model(x).sum()) is False
    finally:
        ro.chmod(0o700)
    if os.geteuid() != 0:  # root may write anyway
        assert guard.last_snapshot is None and guard.last_error


def test_step_fn_losses_from_several_forward_calls_travel(tmp_path):
    """A contrastive loss over two views, no target: `step_fn(model, batch) -> loss`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))

    def simclr_step(m, batch):
        z1, z2 = m(batch["view1"]), m(batch["view2"])
        z1 = z1 / z1.norm(dim=-1, keepdim=True)  # LINE: normalize
        z2 = z2 / z2.norm(dim=-1, keepdim=True)
        logits = z1 @ z2.T / batch["temperature"]
        return F.cross_entropy(logits, torch.arange(len(z1)))

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, step_fn=simclr_step, folder=tmp_path)
    for step in range(4):
        v1, v2 = torch.randn(5, 6), torch.randn(5, 6)
        if step == 3:
            v1 = torch.zeros(5, 6)
            with torch.no_grad():
                model[0].bias.zero_()  # an all-zero view: zero embedding, zero norm, 0/0
                model[2].bias.zero_()
        batch = {"view1": v1, "view2": v2, "temperature": 0.1}
        guard.begin(batch, step=step)
        if not guard.step(simclr_step(model, batch)):
            break
    d = torch.load(guard.last_snapshot, weights_only=True)
    assert d["step"] == 3 and d["batch"]["batch"]["temperature"] == 0.1 and d["loss_spec"]["kind"] == "step_fn"
    res = analyze(guard.last_snapshot, verify=False).to_json()
    assert res["verdict"] == "culprit_found" and res["culprit"]["op"] == "aten.div.Tensor"
    assert res["culprit"]["source"]["code"].startswith("z1 = z1 / z1.norm")
    assert [g["name"] for g in res["gradients"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]


DDP_CODE = r'''
import os, sys
import torch, torch.nn as nn, torch.nn.functional as F
from nanreplay import NanGuard


def worker(rank, folder, store):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder, sync_ranks=True)
    for step in range(5):
        x, y = torch.randn(3, 4), torch.randn(3, 1)
        if step == 2 and rank == 1:
            x[0, 0] = float("nan")  # only rank 1 sees the bad batch
        guard.begin(x, y, step=step)
        if not guard.step(F.mse_loss(model(x), y)):
            break
    with open(os.path.join(os.path.dirname(store), f"rank{rank}.txt"), "w") as f:  # one pipe would interleave
        f.write(f"{rank} {step} {guard.last_snapshot}")
    torch.distributed.barrier()  # gloo aborts a process that tears down while its peer is still connected
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(sys.argv[1], sys.argv[2]), nprocs=2)
'''


def test_ranks_agree_on_the_step_to_snapshot(tmp_path):
    (tmp_path / "ddp_guard.py").write_text(DDP_CODE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "ddp_guard.py", str(tmp_path / "snaps"), str(tmp_path / "store")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    assert [ln[:2] for ln in lines] == [["0", "2"], ["1", "2"]]  # both stopped at step 2, nobody hung
    for rank, _, path in lines:
        d = torch.load(path, weights_only=True)
        assert d["rank"] == int(rank) and d["world_size"] == 2 and d["nonfinite_ranks"] == [1]


def _two_argument_loss(out, target):
    """A loss written with a target parameter the loop passes as None (an unsupervised head): loss_fn(out, None)."""
    assert target is None
    return out.log().mean()  # log of a relu output: -inf at its zeros


def test_a_loss_called_with_none_as_target_is_recorded_as_called(tmp_path):
    # found by the real-bug benchmark's loops: the guard re-recorded `loss_fn(out)` where the loop called
    # `loss_fn(out, None)`, the re-run raised TypeError and the snapshot had no step program
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=_two_argument_loss, folder=tmp_path)
    x = torch.randn(16, 4)
    guard.begin(x)
    assert guard.step(_two_argument_loss(model(x), None)) is False
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap.get("step_program"), snap.get("program_error")
    result = analyze(guard.last_snapshot, verify=False).to_json()
    assert result["verdict"] == "culprit_found" and result["culprit"]["op"].startswith("aten.log")
