"""Capture -> analyze round trips on real training loops, analyzed where the training code is NOT importable.

Each loop trains until NanGuard fires, exactly as the README shows (tuple and dict outputs, the model's own
`(logits, loss)`, `.float()` under bf16 and fp16 autocast, non-tensor batch items, data-dependent control
flow with `.item()`, a `torch.compile`d model, 2-rank DDP on gloo). The snapshot is analyzed in a fresh
process from another folder with no flags, and must name the same culprit (op, phase, module, line) as an
eager replay of the same snapshot with the training code at hand (`--model`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TRAINING_CODE = r'''
import os, sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from nanreplay import NanGuard


class TupleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.aux = nn.Linear(4, 2), nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x), torch.sigmoid(self.aux(x))


def tuple_loss(out, y):
    pred, rate = out
    return F.mse_loss(pred, y) - torch.log(rate).mean()  # LINE: tuple


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return {"logits": h, "gate": torch.sigmoid(h).prod(-1)}


def dict_loss(out, y):
    return F.cross_entropy(out["logits"], y) - torch.log(out["gate"]).mean()  # LINE: dict


class TinyGPT(nn.Module):
    """nanoGPT's convention: forward(idx, targets) -> (logits, loss)."""

    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in nanoGPT

    def forward(self, idx, targets=None):
        x = self.ln(self.wte(idx))
        logits = self.head(x)
        p = F.softmax(logits, dim=-1)
        loss = F.nll_loss(torch.log(p).view(-1, p.size(-1)), targets.view(-1))  # LINE: model_loss
        return logits, loss


class CastNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = self.fc1(x)  # LINE: autocast
        return self.fc2(torch.relu(h)).float()


class ItemsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale, mode):
        h = self.fc(x) * scale
        if mode == "train":
            h = h + 0.5
        return -torch.log(torch.sigmoid(h)).mean()  # LINE: batch_items


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x).abs() + 1
        for _ in range(int(x[0, 0].item() > 0) + 1):  # a loop whose trip count depends on the data
            h = h * 0.5
        if x.sum().item() > 1000:  # a branch only the bad batch takes
            h = h - h.max() - 1
        return torch.sqrt(h).mean()  # LINE: branchy


class CompiledNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return -torch.log(torch.sigmoid(self.fc(x))).mean()  # LINE: compiled


def build(kind):
    torch.manual_seed(0)
    return {"tuple": TupleNet, "dict": DictNet, "model_loss": TinyGPT, "autocast_bf16": CastNet,
            "autocast_fp16": CastNet, "batch_items": ItemsNet, "branchy": Branchy, "compiled": CompiledNet,
            "ddp": CompiledNet}[kind]()


def batch(kind, step, g):
    bad = step == 2  # every loop is healthy for two steps; the third batch breaks it
    big = 1e4 if bad else 1.0
    if kind == "tuple":
        return torch.randn(6, 4, generator=g) * big, torch.randn(6, 2, generator=g)
    if kind == "dict":
        return torch.randn(6, 4, generator=g) * big, torch.randint(0, 3, (6,), generator=g)
    if kind == "model_loss":
        idx = torch.randint(0, 11, (2, 5), generator=g)
        return (idx, idx.roll(1, 1)), None
    if kind == "autocast_fp16":
        return torch.randn(8, 8, generator=g) * (3000.0 if bad else 1.0), torch.zeros(8, 1)
    if kind == "autocast_bf16":
        return torch.randn(8, 8, generator=g) * (1e36 if bad else 1.0), torch.zeros(8, 1)
    if kind == "batch_items":
        return {"x": torch.randn(5, 4, generator=g), "scale": big, "mode": "train"}, None
    if kind == "branchy":
        return torch.randn(5, 4, generator=g) + (1000.0 if bad else 0.0), None
    return torch.randn(5, 4, generator=g) * big, None


def loss_fn_of(kind):
    return {"tuple": tuple_loss, "dict": dict_loss, "autocast_bf16": F.mse_loss,
            "autocast_fp16": F.mse_loss}.get(kind)


def call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def train(kind, folder):
    model = build(kind)
    if kind == "autocast_fp16":
        with torch.no_grad():
            model.fc1.weight.mul_(30)
    wrapped = torch.compile(model, backend="aot_eager") if kind == "compiled" else model
    if kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = loss_fn_of(kind)
    guard = NanGuard(wrapped, opt, loss_fn=loss_fn, folder=folder)
    g = torch.Generator().manual_seed(1)
    amp = {"autocast_bf16": torch.bfloat16, "autocast_fp16": torch.float16}.get(kind)
    for step in range(5):
        inputs, target = batch(kind, step, g)
        if kind == "model_loss" and step == 2:
            with torch.no_grad():
                model.wte.weight.mul_(1000)  # what a far too high learning rate does to the logits
        guard.begin(inputs, target, step=step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            out = call(wrapped, inputs)
            loss = out[1] if kind == "model_loss" else (out if loss_fn is None else loss_fn(out, target))
        ok = guard.loss_ok(loss)
        if kind == "ddp":  # every rank stops at the same step
            flag = torch.tensor([0.0 if ok else 1.0])
            torch.distributed.all_reduce(flag)
            ok = flag.item() == 0
        if not ok:
            break
        loss.backward()
        if not guard.grads_ok():
            break
        opt.step()
    return guard.last_snapshot


def ddp_worker(rank, folder, store):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    path = train("ddp", folder)
    if rank == 0:
        print(path, flush=True)
    torch.distributed.barrier()  # gloo aborts a process that tears down while its peer is still connected
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    for kind in sys.argv[2:]:
        if kind == "ddp":
            import torch.multiprocessing as mp
            mp.spawn(ddp_worker, args=(os.path.join(out, kind), os.path.join(out, "ddp_store")), nprocs=2)
            continue
        print(kind, train(kind, os.path.join(out, kind)))
'''

ANALYZE = r'''
import json, sys
try:
    import trainmod  # noqa: F401
    raise SystemExit("the training code must not be importable here")
except ImportError:
    pass
from nanreplay.analysis import analyze
print(json.dumps({p: analyze(p).to_json() for p in sys.argv[1:]}))
'''

EAGER = r'''
import json, sys
from nanreplay.analysis import analyze
out = {}
for arg in sys.argv[1:]:
    kind, path = arg.split("=", 1)
    loss = {"tuple": "trainmod:tuple_loss", "dict": "trainmod:dict_loss"}.get(kind)
    out[path] = analyze(path, model=f"trainmod:build_{kind}", loss=loss, trust=True, verify=False).to_json()
print(json.dumps(out))
'''

KINDS = ["tuple", "dict", "model_loss", "autocast_bf16", "autocast_fp16", "batch_items", "branchy", "compiled",
         "ddp"]
KEYS = ("op", "phase", "kind", "forward_op", "module")


def _line(marker: str) -> int:
    return next(i for i, ln in enumerate(TRAINING_CODE.splitlines(), 1) if ln.endswith(f"# LINE: {marker}"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("roundtrip")
    proj, elsewhere, snaps = root / "proj", root / "elsewhere", root / "snaps"
    for d in (proj, elsewhere, snaps):
        d.mkdir()
    code = TRAINING_CODE + "".join(f"\n\ndef build_{k}():\n    return build({k!r})\n" for k in KINDS)
    (proj / "trainmod.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "trainmod.py", str(snaps), *KINDS], cwd=proj, capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    paths = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].endswith(".pt"):
            paths[parts[0]] = parts[1]
        elif len(parts) == 1 and parts[0].endswith(".pt"):
            paths["ddp"] = parts[0]
    assert set(paths) == set(KINDS), res.stdout
    (elsewhere / "analyze_it.py").write_text(ANALYZE)
    res = subprocess.run([sys.executable, "analyze_it.py", *paths.values()], cwd=elsewhere, capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    plain = json.loads(res.stdout)
    (proj / "eager_it.py").write_text(EAGER)
    res = subprocess.run([sys.executable, "eager_it.py", *(f"{k}={p}" for k, p in paths.items())], cwd=proj,
                         capture_output=True, text=True, timeout=600, env={**env, "PYTHONPATH": f"{ROOT}:{proj}"})
    assert res.returncode == 0, res.stderr[-3000:]
    eager = json.loads(res.stdout)
    return {k: (paths[k], plain[paths[k]], eager[paths[k]]) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_names_the_eager_culprit_without_the_training_code(runs, kind):
    path, d, eager = runs[kind]
    assert "step program" in d["model"]["how"], d["model"]["how"]
    assert d["verdict"] == eager["verdict"] == "culprit_found", (d["verdict"], d["warnings"])
    assert {k: d["culprit"][k] for k in KEYS} == {k: eager["culprit"][k] for k in KEYS}
    line = (d["culprit"]["source"] or {}).get("line")
    assert line == (eager["culprit"]["source"] or {}).get("line")
    if kind == "autocast_bf16":  # mse_loss overflows: torch's own loss, called by the guard, has no user line
        assert d["culprit"]["module"] == "<loss>" and line is None
    elif d["culprit"]["phase"] == "forward":
        marker = "autocast" if kind.startswith("autocast") else ("compiled" if kind == "ddp" else kind)
        assert line == _line(marker), (kind, d["culprit"]["source"])
    assert not d["warnings"] or all("instrumentation" not in w for w in d["warnings"])


def test_float_under_autocast_probes_and_verifies(runs):
    for kind in ("autocast_bf16", "autocast_fp16"):
        _, d, _ = runs[kind]
        assert d["precision"] and all("error" not in r for r in d["precision"]), d["precision"]
    _, fp16, _ = runs["autocast_fp16"]
    # the batch is 3000x too large: the advice is to normalise `x` (named by forward's own parameter name);
    # bf16 keeps the step finite and computes what the same step computes in float64 (docs/fix-verification.md),
    # but only as "this batch is unusual": verified beside the advice, not instead of it
    assert fp16["diagnosis"]["cause"] == "fp16_overflow" and fp16["diagnosis"]["fix"]["kind"] == "normalize_input"
    assert "`x` holds values up to" in fp16["diagnosis"]["explanation"]
    bf16 = next(f for f in fp16["diagnosis"]["candidates"] if f["kind"] == "bf16_or_grad_scaler")
    assert bf16["replay"]["loss"] is not None
    assert bf16["verified"] is False or "this batch is unusual" in bf16["replay"]["why"], bf16["replay"]


def test_wrappers_are_unwrapped_and_noted(runs):
    for kind in ("compiled", "ddp"):
        path, d, _ = runs[kind]
        names = [g["name"] for g in d["gradients"]]
        assert names == ["fc.weight", "fc.bias"], names  # no module. / _orig_mod. prefixes
    assert runs["compiled"][1]["snapshot_info"]["environment"]["compiled"] is True
    assert runs["ddp"][1]["snapshot_info"]["environment"]["wrapper"] == "DistributedDataParallel"
    assert runs["ddp"][1]["snapshot_info"]["world_size"] == 2


def test_non_tensor_batch_items_travel(runs):
    path, d, _ = runs["batch_items"]
    import torch

    snap = torch.load(path, weights_only=True)
    assert snap["batch"]["inputs"]["scale"] == 1e4 and snap["batch"]["inputs"]["mode"] == "train"


def test_tied_weights_are_stored_once(runs):
    import torch

    snap = torch.load(runs["model_loss"][0], weights_only=True)
    assert snap["aliases"] == {"head.weight": "wte.weight"} and "head.weight" not in snap["state"]
