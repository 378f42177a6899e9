"""The invisibility sweep: the same K training steps with and without NanGuard must be bitwise the same run.

    python benchmarks/invisibility.py                          # every architecture the capture sweep builds
    python benchmarks/invisibility.py --archs nn: cnn: --limit 40 --modes loss step_fn
    python benchmarks/invisibility.py --write                  # also writes benchmarks/invisibility.json

For each architecture of the capture sweep (benchmarks/archs.py: transformers, diffusers, torch.nn stacks and
losses, a BatchNorm CNN, RNN language models), built fresh from the same seed for every run, K=3 AdamW steps are
trained twice — unguarded, then guarded — in each mode users guard a loop with:

* `loss`: `NanGuard(loss_fn=...)` (the architecture's loss, or the model's own where it has one);
* `step_fn`: `NanGuard(step_fn=fn)` with `fn(model, batch) -> loss`;
* `micro`: two micro-batches per optimizer step (`begin(..., micro_batch=k)`, the loss divided by 2);
* `scaler`: a CPU `torch.amp.GradScaler` (`NanGuard(scaler=...)`, `scaler.unscale_` before `grads_ok`);
* `skip`: the `loss` loop whose step 1 has a NaN loss: the guard writes its snapshot and the loop skips the step
  (`zero_grad`, next batch); the unguarded run skips the same step by hand.

After the K steps every loss, weight, buffer, last-step gradient and the RNG state (torch, Python `random`,
numpy) must be bitwise equal, and the guarded run must not raise. Prints `guarded runs identical N/M` and every
difference (each one is a bug in the guard). The trainer integrations (Hugging Face `attach`, Lightning's
callback, Accelerate's `guard_for`) are proven the same way by tests/integrations/test_invisible.py.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import archs as zoo_archs  # noqa: E402
import invisibility_trainers as trainers  # noqa: E402

from nanreplay import NanGuard  # noqa: E402
from nanreplay.replay.subject import call_model, compute_loss  # noqa: E402

HERE = Path(__file__).resolve().parent
K = 3
NAN_STEP = 1
MODES = ("loss", "step_fn", "micro", "scaler", "skip")
TRAINER_ARCHS = ("cnn:resnet", "nn:BatchNorm1d", "nn:TransformerEncoderLayer", "rnn:lstm_lm", "hf:bert", "hf:llama",
                 "hf:vit", "hf:gpt2", "hf:wav2vec2", "hf:resnet")  # also run in the trainer modes
ARCH_SECONDS = 240  # all modes of one architecture; longer is skipped as too slow here


@dataclass
class Row:
    name: str
    family: str
    mode: str
    status: str  # identical | differs | raised | skipped
    differences: list[str] = field(default_factory=list)
    seconds: float = 0.0


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _seed() -> None:
    torch.manual_seed(0)
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:
        pass


def _rng() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        out["numpy"] = np.random.get_state()
    return out


def _clone_grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def train(arch, mode: str, guarded: bool, folder: str) -> dict:
    """K steps of `arch` in `mode`, guarded or not: the run's fingerprint."""
    if mode in trainers.RUNNERS:
        return trainers.RUNNERS[mode](arch, guarded, folder, k=K, seed=_seed, rng=_rng)
    _seed()
    built = arch.make()
    model, loss_fn = built.model, built.loss_fn
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if mode == "scaler" else None

    def step_fn(m, batch):
        return compute_loss(call_model(m, batch[0]), batch[1], loss_fn)

    guard = None
    if guarded:
        kw = {"step_fn": step_fn} if mode == "step_fn" else {"loss_fn": loss_fn}
        guard = NanGuard(model, opt, folder=folder, scaler=scaler, **kw)
    losses, grads, skipped = [], {}, []
    micro = 2 if mode == "micro" else 1
    try:
        for step in range(K):
            opt.zero_grad(set_to_none=True)
            ok = True
            for k in range(micro):
                inputs, target = built.batch(step * micro + k)
                if guard is not None:
                    if mode == "step_fn":
                        guard.begin((inputs, target), step=step)
                    else:
                        guard.begin(inputs, target, step=step, micro_batch=k if micro > 1 else None)
                loss = step_fn(model, (inputs, target)) if mode == "step_fn" else \
                    compute_loss(call_model(model, inputs), target, loss_fn)
                if mode == "skip" and step == NAN_STEP:
                    loss = loss * float("nan")
                losses.append(struct.pack("<d", float(loss.detach().float())).hex())
                if guard is not None:
                    ok = guard.loss_ok(loss)
                else:
                    ok = math.isfinite(float(loss.detach().float()))
                if not ok:
                    break
                scaled = loss / micro
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            if not ok:  # the loop skips the step: no update from it
                opt.zero_grad(set_to_none=True)
                skipped.append(step)
                continue
            if scaler is not None:
                scaler.unscale_(opt)
            if guard is not None and not guard.grads_ok():
                opt.zero_grad(set_to_none=True)
                skipped.append(step)
                if scaler is not None:
                    scaler.update()
                continue
            grads = _clone_grads(model)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
    finally:
        if guard is not None:
            guard.close()
    return {"losses": losses, "skipped": skipped, "grads": grads, "rng": _rng(),
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "snapshots": list(guard.snapshots) if guard is not None else [],
            "optimizer": opt.state_dict()["state"]}


def differences(a, b, where: str = "") -> list[str]:
    """Every place two fingerprints are not bitwise equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
                or a.dtype != b.dtype:
            return [f"{where}: {_kind(a)} vs {_kind(b)}"]
        x, y = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
        if x.is_floating_point() or x.is_complex():
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        return [] if torch.equal(x, y) else [f"{where}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))[:5]}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}" if where else str(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy arrays in numpy's generator state
        return [] if a.shape == b.shape and bool((a == b).all()) else [f"{where}: values differ"]
    return [] if a == b else [f"{where}: {str(a)[:40]} vs {str(b)[:40]}"]


def _kind(x) -> str:
    return f"tensor{list(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def sweep_arch(arch, modes: tuple[str, ...], folder: str) -> list[Row]:
    rows = []
    t0 = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)  # put back after: a caller's own handler (pytest's)
    signal.alarm(ARCH_SECONDS)
    try:
        for mode in modes:
            t1 = time.perf_counter()
            row = Row(arch.name, arch.family, mode, "skipped")
            rows.append(row)
            try:
                plain = train(arch, mode, False, folder)
            except (zoo_archs.Skipped, Exception) as e:  # noqa: BLE001 - the world's code: say why, go on
                if isinstance(e, _Timeout):
                    raise
                row.differences = [f"does not train unguarded: {type(e).__name__}: {str(e)[:160]}"]
                row.seconds = round(time.perf_counter() - t1, 2)
                continue
            try:
                guarded = train(arch, mode, True, folder)
            except _Timeout:
                raise
            except Exception as e:  # noqa: BLE001 - exactly what the sweep is for
                row.status, row.differences = "raised", [f"the guarded run raised {type(e).__name__}: {str(e)[:300]}"]
                row.seconds = round(time.perf_counter() - t1, 2)
                continue
            snaps = guarded.pop("snapshots")
            plain.pop("snapshots")
            row.differences = differences(plain, guarded)
            if mode == "skip" and len(snaps) != 1:
                row.differences.append(f"expected one snapshot of the NaN step, got {len(snaps)}")
            elif mode != "skip" and snaps:
                row.differences.append(f"a healthy run wrote {len(snaps)} snapshot(s)")
            row.status = "differs" if row.differences else "identical"
            row.seconds = round(time.perf_counter() - t1, 2)
    except _Timeout:
        rows[-1].status, rows[-1].differences = "skipped", [f"took longer than {ARCH_SECONDS}s on CPU"]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    del t0
    return rows


def summary(rows: list[Row]) -> dict:
    ran = [r for r in rows if r.status != "skipped"]
    same = [r for r in ran if r.status == "identical"]
    return {"identical": len(same), "ran": len(ran), "skipped": len(rows) - len(ran),
            "architectures": len({r.name for r in ran})}


def as_json(s: dict, rows: list[Row]) -> str:
    """One line per architecture: its family, each mode's status, and what differed or why it did not run."""
    archs: dict[str, dict] = {}
    for r in rows:
        a = archs.setdefault(r.name, {"name": r.name, "family": r.family, "modes": {}, "why": {}})
        a["modes"][r.mode] = r.status
        if r.differences:
            a["why"][r.mode] = r.differences[:10]
    body = ",\n".join("  " + json.dumps(a) for a in archs.values())
    return f'{{\n "summary": {json.dumps(s)},\n "architectures": [\n{body}\n ]\n}}\n'


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="*", help="only architectures whose name contains one of these")
    ap.add_argument("--limit", type=int, help="at most this many architectures (spread evenly)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES + trainers.TRAINER_MODES)
    ap.add_argument("--trainer-archs", nargs="*", default=list(TRAINER_ARCHS),
                    help="architectures (names containing these) also run under Accelerate, Lightning, HF Trainer")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="write benchmarks/invisibility.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import logging
    import warnings

    logging.getLogger("nanreplay").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    archs = zoo_archs.select(zoo_archs.all_archs(), args.archs, args.limit)
    rows: list[Row] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for i, arch in enumerate(archs, 1):
            extra = trainers.TRAINER_MODES if any(n == arch.name for n in args.trainer_archs or ()) else ()
            extra = tuple(m for m in extra if m not in args.modes and (not m.startswith("hf_") or arch.name.startswith("hf:")))
            got = sweep_arch(arch, tuple(args.modes) + extra, folder)
            rows += got
            bad = [r for r in got if r.status in ("differs", "raised")]
            print(f"[{i}/{len(archs)}] {arch.name}: " + ", ".join(f"{r.mode} {r.status}" for r in got), flush=True)
            for r in bad:
                print(f"    {r.mode}: " + "; ".join(r.differences[:6]), flush=True)
    s = summary(rows)
    print(f"\nguarded runs identical {s['identical']}/{s['ran']} ({s['architectures']} architectures x modes "
          f"{', '.join(args.modes)}; the trainer modes on {', '.join(args.trainer_archs or ['none'])}; "
          f"{s['skipped']} runs skipped: they do not train here unguarded; "
          f"{time.perf_counter() - t0:.0f}s)")
    for r in rows:
        if r.status in ("differs", "raised"):
            print(f"  {r.name} [{r.mode}] {r.status}: " + "; ".join(r.differences[:10]))
    if args.write:
        (HERE / "invisibility.json").write_text(as_json(s, rows))
    return 0 if s["identical"] == s["ran"] else 1


if __name__ == "__main__":
    sys.exit(main())
