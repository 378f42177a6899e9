"""Fixes judged by applying them, on loops whose training code the analysis cannot import (#38 items 1 and 4):

* log(softmax(x)) with some probabilities underflowed to subnormals: log_softmax moves those logs by far more than
  rounding — towards their exact value — and is verified (the no-op check compares with a float64 replay of the step);
* acos of a clamped cosine that is exactly 1 for duplicate pairs: the tightest clamp (1 - 6e-8, one float32 step
  below 1) moves acos(1) = 0 by 3.5e-4 — a large share of small angles, but no more than acos moves when its input
  moves by its last bit — and is verified;
* a body the code cast to float16 itself (`.half()`, a float32 head registered first): the advice is about that
  cast, never "use bf16 autocast" (no autocast ran), and its bf16 replay is judged against the step in float64;
* a learning rate multiplied by 1e8 by a schedule bug: the fix sets it back to the rate the history trained at;
* the same bug at 1e20, whose next step makes gradients at the edge of float32 (the guard's re-run overflows their
  norm too): divergence, never a transient fault of the machine;
* a learning rate too high for the data: the rate the fix suggests trains.

Each fix is then applied to the loop by hand and trained on: the healthy steps' losses are unchanged and no value is
non-finite.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from isolation import ROOT, analyze_isolated, load_training_code

pytestmark = pytest.mark.integrations

TRAINING = r'''
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from nanreplay import NanGuard


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 200)

    def forward(self, x):
        return torch.log(torch.softmax(self.fc(x), dim=-1))  # LINE: log softmax


def log_softmax_loop(folder, fixed=False, steps=6):
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.nll_loss, folder=folder)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x, y = torch.randn(64, 8, generator=g), torch.randint(0, 200, (64,), generator=g)
        if step == 3:
            x[:32] *= 60.0  # confident samples: logit gaps up to a few hundred
        guard.begin(x, y, step=step)
        opt.zero_grad()
        out = torch.log_softmax(model.fc(x), -1) if fixed else model(x)
        loss = F.nll_loss(out, y)
        losses.append(float(loss.detach()))
        if not guard.step(loss):
            break
    return guard.last_snapshot, losses, model


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16))

    def forward(self, a, b):
        cos = F.cosine_similarity(self.enc(a), self.enc(b), dim=-1).clamp(-1, 1)
        return torch.acos(cos).mean()  # LINE: acos


def acos_loop(folder, eps=None, steps=6):
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, folder=folder)
    g = torch.Generator().manual_seed(2)
    losses = []
    for step in range(steps):
        a = torch.randn(8, 6, generator=g)
        b = a + 0.05 * torch.randn(8, 6, generator=g)  # near-duplicates: small angles
        if step == 3:
            b[:4] = a[:4]  # exact duplicate pairs: cosine 1 (or 1 - one rounding step)
        guard.begin((a, b), step=step)
        opt.zero_grad()
        if eps is None:
            loss = model(a, b)
        else:
            cos = F.cosine_similarity(model.enc(a), model.enc(b), dim=-1).clamp(-1, 1)
            loss = torch.acos(cos.clamp(-1 + eps, 1 - eps)).mean()
        losses.append(float(loss.detach()))
        if not guard.step(loss):
            break
    return guard.last_snapshot, losses, model


class HalfNet(nn.Module):
    """A body the code casts to float16 itself, its head kept in float32 (registered first)."""
    def __init__(self, dtype=torch.float16):
        super().__init__()
        self.dtype = dtype
        self.head = nn.Linear(1, 1)
        self.body = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64))

    def forward(self, x):
        h = self.body(x.to(self.dtype))  # the cast the code makes
        energy = (h * h).sum(-1, keepdim=True)  # LINE: energy
        return self.head(energy.float() / 64)


def half_loop(folder, dtype=torch.float16, steps=6):
    torch.manual_seed(0)
    model = HalfNet(dtype)
    model.body.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder)
    g = torch.Generator().manual_seed(3)
    losses = []
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.zeros(16, 1)
        if step == 3:
            x[0] *= 300.0  # one loud sample: its 64 features square past float16's 65504
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        if not guard.step(loss):
            break
    return guard.last_snapshot, losses, model


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)


def lr_loop(folder, lr_at=(3, 1e8), steps=8):
    """A schedule bug multiplies the learning rate by 1e8 at one step."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder)
    g = torch.Generator().manual_seed(4)
    losses = []
    for step in range(steps):
        if lr_at and step == lr_at[0]:
            for group in opt.param_groups:
                group["lr"] *= lr_at[1]
        x = torch.randn(32, 8, generator=g)
        y = x.sum(-1, keepdim=True)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        if not guard.step(loss):
            break
    return guard.last_snapshot, losses, model


def blowup_loop(folder, lr=0.35, steps=40):
    """A learning rate too high for a linear model on unnormalised features: the loss grows by orders of
    magnitude each step until it overflows — deterministic, every time."""
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 16, generator=g) * 3
    y = x @ torch.randn(16, 1, generator=g)
    losses = []
    for step in range(steps):
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        if not guard.step(loss):
            break
    return guard.last_snapshot, losses, model


def lr_now_loop(folder, steps=8):
    """The same schedule bug, with an lr the weights cannot survive one update of."""
    return lr_loop(folder, lr_at=(4, 1e20), steps=steps)


if __name__ == "__main__":
    for kind in sys.argv[2:]:
        snap, losses, _ = globals()[kind + "_loop"](f"{sys.argv[1]}/{kind}")
        print(kind, snap, flush=True)
'''

KINDS = ("log_softmax", "acos", "half", "lr", "lr_now", "blowup")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixref")
    proj = root / "proj"
    proj.mkdir()
    (proj / "fixloops.py").write_text(TRAINING)
    res = subprocess.run([sys.executable, "fixloops.py", str(root), *KINDS], cwd=proj, capture_output=True, text=True,
                         timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    paths = dict(ln.split() for ln in res.stdout.splitlines() if ln.split() and ln.split()[0] in KINDS)
    assert set(paths) == set(KINDS) and all(p.endswith(".pt") for p in paths.values()), res.stdout
    out = analyze_isolated(list(paths.values()), root / "elsewhere", also_blocked=("fixloops",))
    return {k: out[paths[k]] for k in KINDS}


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    """The same training code, imported here to apply each fix by hand."""
    return load_training_code(tmp_path_factory.mktemp("fixapply"), "fixloops_applied", TRAINING)


def _trains(losses: list[float], steps: int) -> None:
    assert len(losses) == steps and all(math.isfinite(v) for v in losses), losses


def test_log_softmax_replaces_log_of_softmax_and_is_verified(runs, loops, tmp_path):
    d = runs["log_softmax"]
    assert d["diagnosis"]["cause"] == "log_softmax", d["diagnosis"]["cause"]
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "log_softmax" and fix["verified"] is True, fix["verification"]
    assert "torch.log_softmax(self.fc(x), dim=-1)" in fix["code"], fix["code"]
    # beyond rounding, but towards the float64 value: the reference is the step itself in float64
    assert "no farther from a float64 replay of the step than the original's own error" in fix["verification"]
    _, broken, _ = loops.log_softmax_loop(tmp_path / "a")
    _, fixed, _ = loops.log_softmax_loop(tmp_path / "b", fixed=True)
    _trains(fixed, 6)
    assert not math.isfinite(broken[-1])
    assert fixed[:3] == pytest.approx(broken[:3], rel=1e-5, abs=1e-6)  # the healthy steps are the same steps


def test_acos_of_a_clamped_cosine_gets_the_tightest_clamp_verified(runs, loops, tmp_path):
    d = runs["acos"]
    assert d["diagnosis"]["cause"] == "acos_asin_boundary", d["diagnosis"]["cause"]
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "clamp" and fix["verified"] is True, fix["verification"]
    assert fix["epsilon"] == pytest.approx(6e-8) and "clamp(-1 + 6e-8, 1 - 6e-8)" in fix["code"], fix["code"]
    _, broken, _ = loops.acos_loop(tmp_path / "a")
    _, fixed, model = loops.acos_loop(tmp_path / "b", eps=fix["epsilon"])
    _trains(fixed, 6)
    # the original stops at the duplicate pairs where their cosine rounds to exactly 1 — on ATen's default (no
    # vector) path it rounds one step below 1 and the original trains on: whether it breaks is the math path's
    assert len(broken) == 4 or (len(broken) == 6 and all(math.isfinite(v) for v in broken)), broken
    assert fixed[:3] == pytest.approx(broken[:3], rel=1e-6, abs=1e-7)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_half_model_gets_advice_about_its_cast_not_about_autocast(runs, loops, tmp_path):
    d = runs["half"]
    assert d["diagnosis"]["cause"] == "fp16_overflow", d["diagnosis"]["cause"]
    assert not (d.get("snapshot_info") or {}).get("autocast"), d.get("snapshot_info", {}).get("autocast")
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "bf16_or_grad_scaler" and fix["verified"] is True, fix["verification"]
    assert "torch.autocast" not in fix["code"] and "no autocast ran" in fix["code"] and "`body`" in fix["code"]
    assert "autocast(" not in d["diagnosis"]["explanation"].split("alternatives")[0]
    _, broken, _ = loops.half_loop(tmp_path / "a")
    _, fixed, model = loops.half_loop(tmp_path / "b", dtype=torch.bfloat16)  # the cast made bfloat16
    _trains(fixed, 6)
    assert not math.isfinite(broken[-1])
    assert fixed[:3] == pytest.approx(broken[:3], rel=5e-2, abs=1e-3)  # bfloat16 rounds more coarsely than float16


def _rate(code: str, pattern: str) -> float:
    m = re.search(pattern, code)
    assert m, code
    return float(m.group(1))


def test_a_learning_rate_jump_is_set_back_to_the_rate_of_the_history(runs, loops, tmp_path):
    d = runs["lr"]
    assert d["diagnosis"]["cause"] == "training_diverged", d["diagnosis"]["cause"]
    code = d["diagnosis"]["fix"]["code"]
    assert "typo" not in code and "1e-06" not in code, code  # never the exponent's sign flipped
    lr = _rate(code, r"set it back to ([0-9.e+-]+)")
    assert lr == pytest.approx(1e-2), code
    _, broken, _ = loops.lr_loop(tmp_path / "a")
    _, fixed, _ = loops.lr_loop(tmp_path / "b", lr_at=(3, lr / 1e-2))  # the schedule's step, back at that rate
    _trains(fixed, 8)
    assert not math.isfinite(broken[-1])
    assert fixed[:4] == pytest.approx(broken[:4], rel=1e-6, abs=1e-7)


def test_a_deterministic_blow_up_is_divergence_not_a_transient_fault(runs):
    d = runs["lr_now"]
    dg = d["diagnosis"]
    assert dg["cause"] == "training_diverged" and "transient" not in dg["title"], (dg["cause"], dg["title"])
    machine = (d.get("differential") or {}).get("machine")
    assert machine is None or machine["verdict"] != "transient", machine
    assert "set it back to 0.01" in dg["fix"]["code"], dg["fix"]["code"]


def test_the_learning_rate_the_fix_suggests_trains(runs, loops, tmp_path):
    d = runs["blowup"]
    assert d["diagnosis"]["cause"] == "training_diverged", d["diagnosis"]["cause"]
    code = d["diagnosis"]["fix"]["code"]
    lr = _rate(code, r"e\.g\. (?:to )?([0-9.e+-]+)")
    assert lr < 0.35, code
    _, broken, _ = loops.blowup_loop(tmp_path / "a")
    _, fixed, _ = loops.blowup_loop(tmp_path / "b", lr=lr)
    _trains(fixed, 40)
    assert not math.isfinite(broken[-1]) and fixed[-1] < fixed[0]
