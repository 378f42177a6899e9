"""CUDA capture and replay, checked in one run: the script a session with a GPU runs (docs/cuda.md).

    python benchmarks/cuda_check.py --out DIR            # on a machine with CUDA
    python benchmarks/cuda_check.py --out DIR --device cpu   # the same loops on the CPU (checks the script itself)

Three real training loops, each with NanGuard as the README shows, each failing for a known reason:

* `bf16_rmsnorm_rsqrt`   bf16 autocast, causal SDPA (flash attention on CUDA), an RMSNorm without eps that
                         meets an all-zero embedding row: rsqrt(0) → NaN (culprit: aten.rsqrt).
* `bf16_masked_row`      bf16 autocast, SDPA with an additive -inf padding mask whose row masks every key:
                         softmax over nothing → NaN (culprit: the attention op).
* `fp16_scaler_overflow` fp16 autocast + GradScaler, one weight scaled ×1e5: a forward overflow past 65504
                         (culprit: the linear's matmul).

Each snapshot is analyzed with `nanreplay analyze --json` on the capture device and with `--device cpu`; the
script compares the culprit (op, module, line), the cause and the fix's verification between the two, and the
wall times, and writes `DIR/cuda_check.json` and `DIR/cuda_check.md`. A loop that does not fail, or an analysis
that errs, is a row saying so: the script always finishes and exits 0 unless its own arguments are wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard

VOCAB, D, HEADS, SEQ, BATCH = 256, 128, 4, 64, 8


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.w, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


class Block(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d, eps), RMSNorm(d, eps)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, HEADS, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(D, eps) for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx, mask=None):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(x)


def _lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def bf16_rmsnorm_rsqrt(device: str, folder: Path) -> str | None:
    torch.manual_seed(0)
    model = TinyGPT(eps=0.0).to(device)
    with torch.no_grad():
        model.emb.weight[0].zero_()  # token 0's embedding is all zeros: the eps-less RMSNorm divides by 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=_lm_loss, folder=folder)
    for step in range(20):
        x = torch.randint(1, VOCAB, (BATCH, SEQ), device=device)
        if step == 5:
            x[2, 7] = 0
        y = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = _lm_loss(model(x), y)
        if not guard.loss_ok(loss):
            return guard.last_snapshot
        loss.backward()
        if not guard.grads_ok():
            return guard.last_snapshot
        opt.step()
    return None


def bf16_masked_row(device: str, folder: Path) -> str | None:
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step_fn(m, batch):
        return _lm_loss(m(batch["idx"], batch["mask"]), batch["y"])

    guard = NanGuard(model, opt, step_fn=step_fn, folder=folder)
    causal = torch.full((SEQ, SEQ), float("-inf"), device=device).triu(1)
    for step in range(20):
        pad = torch.zeros(BATCH, 1, 1, SEQ, device=device)
        if step == 5:
            pad[3, ..., :] = float("-inf")  # a sample with every position padded: its rows mask every key
        batch = {"idx": torch.randint(0, VOCAB, (BATCH, SEQ), device=device), "mask": causal + pad,
                 "y": torch.randint(0, VOCAB, (BATCH, SEQ), device=device)}
        guard.begin(batch, step=step)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = step_fn(model, batch)
        if not guard.loss_ok(loss):
            return guard.last_snapshot
        loss.backward()
        if not guard.grads_ok():
            return guard.last_snapshot
        opt.step()
    return None


def fp16_scaler_overflow(device: str, folder: Path) -> str | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, scaler=scaler, folder=folder)
    for step in range(20):
        if step == 5:
            with torch.no_grad():
                model[2].weight.mul_(1e5)  # one layer's weights blow up: its output passes fp16's 65504
        x, y = torch.randn(32, 64, device=device) * 4, torch.randint(0, 10, (32,), device=device)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        if not guard.loss_ok(loss):
            return guard.last_snapshot
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if not guard.grads_ok():
            return guard.last_snapshot
        scaler.step(opt)
        scaler.update()
    return None


LOOPS = {"bf16_rmsnorm_rsqrt": (bf16_rmsnorm_rsqrt, "aten.rsqrt"),
         "bf16_masked_row": (bf16_masked_row, "scaled_dot_product"),
         "fp16_scaler_overflow": (fp16_scaler_overflow, "aten.addmm")}


def analyze(snapshot: str, device: str, out: Path) -> dict:
    """`nanreplay analyze SNAPSHOT --json` in a fresh process on `device`: the fields compared, and the wall time."""
    j = out / f"{Path(snapshot).stem}.{device}.json"
    cmd = [sys.executable, "-m", "nanreplay.cli", "analyze", snapshot, "--device", device, "--json", str(j),
           "-o", str(out / f"{Path(snapshot).stem}.{device}.html")]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    row = {"device": device, "seconds": round(time.perf_counter() - t0, 2), "exit": p.returncode}
    if p.returncode not in (0, 1) or not j.exists():
        row["error"] = (p.stderr.strip().splitlines() or ["(no message)"])[-1][:400]
        return row
    a = json.loads(j.read_text())
    c, d = a.get("culprit") or {}, a.get("diagnosis") or {}
    src, fix = c.get("source") or {}, d.get("fix") or {}
    row.update(verdict=a.get("verdict"), op=c.get("op"), module=c.get("module"),
               line=f"{Path(str(src['file'])).name}:{src.get('line')}" if src.get("file") else None,
               cause=d.get("cause"), fix=fix.get("code"), fix_verified=bool(fix.get("verified")),
               precision=[(r.get("dtype"), r.get("loss_finite"), r.get("grads_finite")) for r in a.get("precision") or []],
               timings=(a.get("stats") or {}).get("timings"), warnings=a.get("warnings"))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda", help="capture device (default cuda; cpu checks the script)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("cuda_check: no CUDA device here; --device cpu runs the same loops on the CPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "python": platform.python_version(), "capture_device": args.device,
           "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
           "cuda": torch.version.cuda, "host_cpus": os.cpu_count()}
    rows = []
    for name, (loop, expected) in LOOPS.items():
        t0 = time.perf_counter()
        try:
            snap = loop(args.device, args.out / name)
        except Exception as e:  # noqa: BLE001 - a loop that breaks is a row, not the end of the check
            rows.append({"loop": name, "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        row = {"loop": name, "expected_op": expected, "snapshot": snap, "capture_seconds": round(time.perf_counter() - t0, 2)}
        if snap:
            row["size_mb"] = round(os.path.getsize(snap) / 2**20, 2) if os.path.isfile(snap) else None
            devices = [args.device] + (["cpu"] if args.device != "cpu" else [])
            row["analyses"] = [analyze(snap, dev, args.out) for dev in devices]
            ops = {a.get("op") for a in row["analyses"]}
            row["culprit_agrees"] = len(ops) == 1 and all(a.get("op") for a in row["analyses"])
            row["expected_found"] = all(expected in str(a.get("op")) for a in row["analyses"])
        rows.append(row)
    result = {"environment": env, "loops": rows}
    (args.out / "cuda_check.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "cuda_check.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"torch {env['torch']}, capture on {env['capture_device']} ({env['gpu'] or 'no GPU'}, CUDA {env['cuda']})",
             "", "| loop | analyzed on | culprit op | module | line | cause | fix verified | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["loops"]:
        if "error" in r or not r.get("snapshot"):
            lines.append(f"| {r['loop']} | — | {r.get('error') or 'no snapshot: the loop did not fail'} | | | | | |")
            continue
        for a in r["analyses"]:
            what = a.get("error") or a.get("op")
            lines.append(f"| {r['loop']} | {a['device']} | {what} | {a.get('module')} | {a.get('line')} | {a.get('cause')} | "
                         f"{a.get('fix_verified')} | {a['seconds']} |")
    lines.append("")
    for r in result["loops"]:
        if r.get("analyses"):
            lines.append(f"- {r['loop']}: culprit the same on every device: {r['culprit_agrees']}; the expected op "
                         f"({r['expected_op']}): {r['expected_found']}; capture {r['capture_seconds']} s, "
                         f"snapshot {r['size_mb']} MB")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
