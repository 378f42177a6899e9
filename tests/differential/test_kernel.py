"""The kernel differential (#31 item 2): a fused culprit replayed alone against its reference composition.

What torch 2.13's CPU flash attention and the math composition really do was checked first (see the first
tests): on a fully masked row both give 0, forward and backward — no difference to test there. Where they do
differ: the CPU flash kernel forms q·kᵀ unscaled and scales after, while the math composition scales q and k by
√scale first, so queries and keys large enough that q·kᵀ overflows float32 (and q·kᵀ·scale does not) break the
kernel and not the math. That is the `kernel_differs` case; ten times larger breaks both (`reference_agrees`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.analysis import analyze
from nanreplay.differential import reference
from nanreplay.report.markdown import markdown_summary
from nanreplay.report.page import build_view
from nanreplay.report.sources import Sources
from nanreplay.report.terminal import terminal_summary

ROOT = Path(__file__).resolve().parents[2]

aten = torch.ops.aten
FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _flash(q, k, v, mask=None, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)[0]


def _math(q, k, v, mask=None, scale=None):
    return aten._scaled_dot_product_attention_math(q, k, v, mask, scale=scale)[0]


def _fwd_bwd(fn, q, k, v, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kw)
    out.sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


def _sdpa_math(q, k, v, mask=None, scale=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("mask_kind", ["bool", "-inf", "finfo.min"])
def test_fully_masked_row_is_zero_in_cpu_flash_and_math_alike(mask_kind):
    """torch 2.13: a query row that may attend to nothing gives 0 (not NaN) in the CPU flash kernel and in the
    math backend (what sdpa_kernel(MATH) runs, and the math op on the float mask the kernel was given), forward
    and backward: no difference to test on a fully masked row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[1] = False
    user = {"bool": keep, "-inf": torch.where(keep, 0.0, float("-inf")),
            "finfo.min": torch.where(keep, 0.0, torch.finfo(torch.float32).min)}[mask_kind]
    given = torch.where(keep, 0.0, float("-inf")) if mask_kind == "bool" else user  # what the kernel receives
    fo, fg = _fwd_bwd(_flash, q, k, v, mask=given)
    for fn, mask in ((_math, given), (_sdpa_math, user)):
        mo, mg = _fwd_bwd(fn, q, k, v, mask=mask)
        assert torch.isfinite(fo).all() and torch.isfinite(mo).all()
        if mask_kind != "finfo.min":  # finfo.min is a finite mask: that row attends uniformly, in both
            assert fo[:, :, 1].abs().max() == 0 and mo[:, :, 1].abs().max() == 0
        torch.testing.assert_close(fo, mo, rtol=1e-4, atol=1e-5)
        for a, b in zip(fg, mg, strict=True):
            assert torch.isfinite(a).all() and torch.isfinite(b).all()
            if mask_kind != "finfo.min":  # there the two backward passes differ, finitely (torch 2.13: the
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # masked row's q-gradient): not a NaN


def test_cpu_flash_overflows_on_unscaled_scores_where_math_does_not():
    """q·kᵀ = 64·(3e18)² overflows float32 before the kernel scales it; the math scales q and k first."""
    q = k = torch.full((1, 1, 4, 64), 3e18)
    v = torch.randn(1, 1, 4, 64)
    assert not torch.isfinite(_flash(q, k, v)).all()
    assert torch.isfinite(_math(q, k, v)).all()
    big = q * 10  # ... and ten times larger overflows both
    assert not torch.isfinite(_flash(big, big, v)).all() and not torch.isfinite(_math(big, big, v)).all()


# ------------------------------------------------------------------ the table, every row


@pytest.mark.parametrize("op", sorted(reference.TABLE))
def test_every_row_reference_computes_the_kernel(op):
    """Each row's reference on its example equals the kernel (in float32, within rounding) and runs in float64.
    A kernel that cannot run here (CUDA's) is checked against the contract it shares with one that can:
    F.scaled_dot_product_attention on the same call."""
    row = reference.TABLE[op]
    assert row.why_not() is None
    a = row.example()
    got = row.compose(dict(a))
    assert got is not None and all(torch.isfinite(t).all() for t in got)
    try:
        want = row.overload(**a)
    except (NotImplementedError, RuntimeError) as e:
        if "attention" not in op:
            raise
        assert "CPU" in str(e) or "cpu" in str(e) or "backend" in str(e), e
        want = (F.scaled_dot_product_attention(a["query"], a["key"], a["value"],
                                               attn_mask=a.get("attn_mask", a.get("attn_bias"))),)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want, strict=False):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    wide = row.compose({n: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                        for n, v in row.example().items()})
    assert all(t.dtype == torch.float64 for t in wide)


def test_lstm_reference_runs_reversed_and_without_biases():
    row = reference.TABLE["aten.mkldnn_rnn_layer.default"]
    for change in ({"reverse": True}, {"has_biases": False}):
        a = {**reference._lstm_example(), **change}
        for t, want in zip(row.compose(a), row.overload(**a)[:3], strict=True):
            torch.testing.assert_close(t, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ whole analyses


class Attn(nn.Module):
    """One attention layer whose queries and keys are about `gain` (a run whose q/k projections grew); `scale`
    is the attention's own (None: 1/√64). `random`: q/k weights random (random-signed scores), not constant."""

    def __init__(self, gain: float, scale: float | None = None, random: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 1)
        self.scale = scale
        with torch.no_grad():
            for lin in (self.q, self.k):
                lin.weight.copy_(torch.randn(64, 64) * gain / 8 if random else torch.full((64, 64), gain / 64))
                lin.bias.zero_()

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, 1, d).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # CULPRIT: the CPU flash kernel
        return self.head(a.transpose(1, 2).reshape(b, t, d)).mean()


def _snapshot(tmp_path, gain: float, scale: float | None = None, random: bool = False):
    torch.manual_seed(0)
    model = Attn(gain, scale, random)
    x = torch.randn(2, 4, 64) if random else torch.ones(2, 4, 64) + 0.01 * torch.rand(2, 4, 64)
    guard = NanGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), folder=tmp_path)
    guard.begin(x, None, step=0)
    assert not guard.step(model(x))
    return guard.last_snapshot


def test_kernel_differs_and_the_math_backend_fix_is_verified(tmp_path):
    d = analyze(_snapshot(tmp_path, 3e18)).to_json()
    assert d["culprit"]["op"] == FLASH
    k = d["differential"]["kernel"]
    assert k["verdict"] == "kernel_differs" and k["skipped"] is None
    kernel, ref, ref64 = k["ran"]
    assert (kernel["what"], kernel["dtype"], kernel["finite"]) == ("kernel", "float32", False)
    assert (ref["what"], ref["dtype"], ref["finite"]) == ("reference", "float32", True)
    assert (ref64["dtype"], ref64["finite"]) == ("float64", True)
    assert kernel["nan"] > 0 and k["reference_matches_float64"] is True
    fix = k["fix"]
    assert fix["kind"] == "reference_backend" and fix["verified"] is True and "SDPBackend.MATH" in fix["code"]
    assert "1 call of the kernel replaced" in fix["verification"]
    assert fix["replay"]["loss"] is not None and fix["replay"]["grad_norm"] is not None
    diag = d["diagnosis"]
    assert diag["cause"] == "kernel_differs" and diag["fix"] == fix and diag["replaces"]["cause"]
    assert "the kernel, not your math" in diag["title"].lower()
    # the first screen says it: the section right under the verdict, and one line in the summaries
    view = build_view(d, Sources())
    assert [s.id for s in view.sections][:2] == ["verdict", "kernel"] and view.kernel.decides
    assert "the kernel, not your math" in terminal_summary(d, None)
    assert "**Kernel replay:**" in markdown_summary(d)


def _backward_case(folder: str) -> dict:
    return analyze(_snapshot(Path(folder), 2e19, scale=1e-10, random=True)).to_json()


def test_a_backward_kernel_culprit_is_replayed_with_the_gradient_that_reached_it(tmp_path):
    """A tiny `scale` keeps the forward finite, but the flash kernel's backward recomputes q·kᵀ unscaled: the
    culprit is its backward op; the node is replayed forward and backward with the incoming gradient recorded
    in a re-run of the step, and the math backward is finite on the same inputs.

    The forward passes `scale` to its q·kᵀ gemm as alpha, and whether MKL applies alpha before its float32 sums
    overflow is MKL's code path's choice: its AVX2 and AVX-512 kernels on Intel CPUs sum first (the forward
    breaks too, and the culprit is the forward op), its compatible path (MKL_CBWR=COMPATIBLE, and what MKL
    runs on AMD CPUs) does not. The step and its analysis run in a child with MKL_CBWR=COMPATIBLE, which gives
    the same results on every CPU: the case exists on each machine alike."""
    if not torch.backends.mkl.is_available():
        pytest.skip("this torch has no MKL: the case is built on MKL's compatible path")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from test_kernel import _backward_case; "
            "print(json.dumps(_backward_case(sys.argv[2]), default=str))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MKL_CBWR": "COMPATIBLE",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["culprit"]["phase"] == "backward" and d["culprit"]["forward_op"] == FLASH
    k = d["differential"]["kernel"]
    assert k["phase"] == "backward" and k["verdict"] == "kernel_differs"
    assert [(r["what"], r["outputs"], r["grads_finite"]) for r in k["ran"]] == [
        ("kernel", "input gradients", False), ("reference", "input gradients", True),
        ("reference", "input gradients", True)]
    assert k["fix"]["verified"] is True and d["diagnosis"]["cause"] == "kernel_differs"


def test_reference_agrees_when_the_math_breaks_too(tmp_path):
    d = analyze(_snapshot(tmp_path, 3e19)).to_json()
    k = d["differential"]["kernel"]
    assert k["verdict"] == "reference_agrees" and k["fix"] is None
    assert [r["finite"] for r in k["ran"]] == [False, False, True]  # float64 is wide enough: a range problem
    assert "Your math, not the kernel" in k["sentence"] and "float64 it is finite" in k["sentence"]
    assert d["diagnosis"]["cause"] != "kernel_differs"
    view = build_view(d, Sources())
    ids = [s.id for s in view.sections]
    assert not view.kernel.decides and ids.index("kernel") > ids.index("chain")


def test_a_plain_culprit_asks_no_kernel_question(tmp_path):
    d = analyze("sample_snapshots/sqrt_zero.pt").to_json()
    assert "kernel" not in (d.get("differential") or {})  # (the guard's re-run, its machine question, is there)


def test_the_float64_probe_of_an_lstm_program_runs_the_native_lstm(tmp_path):
    """oneDNN's mkldnn_rnn_layer has no float64 kernel: the probe's float64 row ran into it ("cannot run");
    it now replays that node as the native LSTM ops."""
    from nanreplay.formats import load
    from nanreplay.formats.program import decode

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lstm, self.head = nn.Embedding(20, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 5)

        def forward(self, x):
            h, _ = self.lstm(self.emb(x))
            return self.head(h + (h - h).pow(2).sum(-1, keepdim=True).sqrt())  # sqrt(0): an infinite gradient

    torch.manual_seed(0)
    model = Tagger()

    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, 5), y.reshape(-1))

    guard = NanGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn, folder=tmp_path)
    x, y = torch.randint(0, 20, (2, 6)), torch.randint(0, 5, (2, 6))
    guard.begin(x, y, step=0)
    assert not guard.step(loss_fn(model(x), y))
    snap = guard.last_snapshot
    ops = {n.name for n in decode(load(snap).raw["step_program"]).nodes}
    if "aten.mkldnn_rnn_layer.default" not in ops:
        pytest.skip("this torch build records no oneDNN LSTM layer on CPU")
    d = analyze(snap).to_json()
    row = {r["dtype"]: r for r in d["precision"]}["float64"]
    assert "error" not in row, row
    assert "aten.mkldnn_rnn_layer.default" in row["replaced"]
    assert row["loss_finite"] is True and row["grads_finite"] is False  # sqrt(0)'s gradient: any dtype
    assert "math domain error" in d["diagnosis"]["precision"]
