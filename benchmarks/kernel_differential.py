"""What the kernel differential (differential/kernel.py) costs relative to the plain analysis.

A small transformer block whose queries and keys grew (the CPU flash kernel overflows on q·kᵀ, the math
backend does not: `kernel_differs`, its MATH fix verified by a whole step), and an fp16 Linear overflow (an
addmm culprit: `reference_agrees`, no fix replay). Each is analyzed with and without the kernel replay
(best of N, load excluded); the ratio is (replay + diagnose + precision) with / without.

    OMP_NUM_THREADS=1 nice python benchmarks/kernel_differential.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.analysis import analyze, pipeline


class Block(nn.Module):
    def __init__(self, d: int, gain: float):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 1)
        with torch.no_grad():
            for lin in (self.q, self.k):
                lin.weight.fill_(gain / d)
                lin.bias.zero_()

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, 4, d // 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return self.head(self.norm(x + a + self.mlp(x))).mean()


def sdpa_snapshot(folder: str, d: int = 128, t: int = 64) -> str:
    torch.manual_seed(0)
    model = Block(d, 3e18 * (d / 4 / 64) ** -0.5 * 1.0)  # q·kᵀ ≈ 2 × float32's max unscaled, finite scaled
    x = torch.ones(4, t, d) + 0.01 * torch.rand(4, t, d)
    guard = NanGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), folder=folder)
    guard.begin(x, None, step=0)
    assert not guard.step(model(x)), "the step did not go non-finite"
    return guard.last_snapshot


def timed(path: str, repeat: int, with_kernel: bool) -> tuple[float, dict]:
    real = pipeline.kernel_diff.attach
    if not with_kernel:
        pipeline.kernel_diff.attach = lambda *a, **k: None
    try:
        best, d = float("inf"), {}
        for _ in range(repeat):
            d = analyze(path).to_json()
            t = d["stats"]["timings"]
            best = min(best, t["replay"] + t["diagnose"] + t["precision"])
        return best, d
    finally:
        pipeline.kernel_diff.attach = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cases = {"sdpa (kernel_differs)": sdpa_snapshot(tmp), "fp16 addmm (reference_agrees)":
                 "sample_snapshots/fp16_overflow.pt"}
        for name, path in cases.items():
            base, _ = timed(path, args.repeat, False)
            full, d = timed(path, args.repeat, True)
            k = d["differential"]["kernel"]
            print(f"{name}: verdict {k['verdict']}; analysis without {base:.3f} s, with {full:.3f} s "
                  f"(x{full / base:.2f}); the kernel replay itself {k['seconds']:.3f} s")


if __name__ == "__main__":
    main()
