"""Tiny configs of public architectures, written here (no downloads), each with the failure a field test found,
trained under NanGuard and analyzed in a fresh process where the training code is NOT importable.

* nanoGPT-style: tied `lm_head`/`wte`, `forward(idx, targets) -> (logits, loss)` with `loss_fn=None`; a run
  whose gradients grow huge but stay finite (their float32 norm overflows): its own trigger, named divergence;
  the tied weight is one gradient row under both names.
* minGPT-style manual attention with a user padding mask filled with -inf: an all-padding sequence makes a
  softmax row NaN in every block; the `finfo.min` fix is a change to the line, verified at every call.
* ResNet-style CNN with BatchNorm in train mode, fed a batch whose per-image standardisation turned a blank
  image into NaN: the snapshot holds the running stats as the step began (finite), the verdict names the
  input and its bad sample, also in the terminal summary.
"""

from __future__ import annotations

import pytest
import torch
from isolation import marker_line, train_then_analyze

TRAINING = r'''
import math, sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from nanreplay import NanGuard


class Block(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.n_head = h

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, vocab=64, d=32, layers=2, block=16):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
                                              h=nn.ModuleList([Block(d) for _ in range(layers)]), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class MinGPTAttention(nn.Module):
    def __init__(self, d=16, h=2):
        super().__init__()
        self.key, self.query, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj, self.n_head = nn.Linear(d, d), h

    def forward(self, x, pad):
        B, T, C = x.size()
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(pad[:, None, None, :], float("-inf"))  # LINE: mingpt
        att = F.softmax(att, dim=-1)  # LINE: softmax
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return x + self.proj(y)


class MinGPT(nn.Module):
    def __init__(self, vocab=32, d=16, layers=3):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([MinGPTAttention(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, pad):
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x, pad)
        return self.head(x)


def basic_block(c):
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))


class TinyResNet(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.layer1 = basic_block(8)
        self.fc = nn.Linear(8, classes)

    def forward(self, images):
        x = F.relu(self.bn1(self.conv1(images)))
        x = F.relu(x + self.layer1(x))
        return self.fc(x.mean((2, 3)))


def standardize(img):
    return (img - img.mean()) / img.std()  # a blank image has std 0: NaN


def nanogpt(folder):
    torch.manual_seed(0)
    model = NanoGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, folder=folder)  # loss_fn=None: the model returns (logits, loss)
    g = torch.Generator().manual_seed(0)
    for step in range(10):
        idx = torch.randint(0, 64, (4, 16), generator=g)
        if step >= 4:  # what a learning rate far too high does, step by step: the weights grow without bound
            with torch.no_grad():
                model.transformer.ln_f.weight.mul_(1e5 if step < 6 else 1e10)
        guard.begin((idx, idx.roll(-1, 1)), step=step)
        opt.zero_grad()
        logits, loss = model(idx, idx.roll(-1, 1))
        if not guard.loss_ok(loss):
            break
        loss.backward()
        if not guard.grads_ok(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
            break
        opt.step()
    return guard.last_snapshot


def mingpt(folder):
    torch.manual_seed(0)
    model = MinGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
                     folder=folder)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        idx = torch.randint(0, 32, (3, 6), generator=g)
        pad = torch.zeros(3, 6, dtype=torch.bool)
        pad[:, 4:] = True
        if step == 3:
            pad[1] = True  # an all-padding sequence reaches the model
        guard.begin((idx, pad), idx, step=step)
        opt.zero_grad()
        if not guard.step(guard.loss_fn(model(idx, pad), idx)):
            break
    return guard.last_snapshot


def resnet(folder):
    torch.manual_seed(0)
    model = TinyResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=folder)
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        raw = torch.rand(4, 3, 8, 8, generator=g)
        if step == 4:
            raw[2] = 0.5  # a blank (constant) image
        images = torch.stack([standardize(img) for img in raw])
        y = torch.randint(0, 5, (4,), generator=g)
        guard.begin(images, y, step=step)
        if not guard.step(F.cross_entropy(model(images), y)):
            break
    return guard.last_snapshot


if __name__ == "__main__":
    for kind in sys.argv[2:]:
        print(kind, {"nanogpt": nanogpt, "mingpt": mingpt, "resnet": resnet}[kind](f"{sys.argv[1]}/{kind}"))
'''

ANALYZE = r'''
import json, sys
from click.testing import CliRunner
for name in ("trainmod", "model"):
    try:
        __import__(name)
        raise SystemExit(f"the training code must not be importable here ({name})")
    except ImportError:
        pass
from nanreplay.analysis import analyze
from nanreplay.cli import main
out = {}
for p in sys.argv[1:]:
    d = analyze(p).to_json()
    d["_terminal"] = CliRunner().invoke(main, ["analyze", p, "-o", p + ".html"]).output
    out[p] = d
print(json.dumps(out))
'''

KINDS = ("nanogpt", "mingpt", "resnet")


def _line(marker: str) -> int:
    return marker_line(TRAINING, marker)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_then_analyze(tmp_path_factory.mktemp("public"), TRAINING, KINDS, ANALYZE)


def test_nanogpt_norm_overflow_is_divergence_and_tied_weights_are_one_row(runs):
    path, d = runs["nanogpt"]
    snap = torch.load(path, weights_only=True)
    assert snap["trigger"] == "grad_norm_overflow" and snap["loss_spec"] == {"kind": "output"}
    assert all(torch.isfinite(t).all() for t in snap["state"].values())
    assert snap["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    assert d["diagnosis"]["cause"] == "training_diverged" and d["diagnosis"]["fix"]["kind"] == "lower_lr_clip_grads"
    assert "overflowed float32" in d["diagnosis"]["explanation"] and "climbed" in d["diagnosis"]["explanation"]
    rows = {r["name"]: r for r in d["gradients"]}
    assert "lm_head.weight" not in rows and rows["transformer.wte.weight"]["has_grad"]
    assert rows["transformer.wte.weight"]["also"] == ["lm_head.weight"]


def test_mingpt_padding_fix_is_verified_at_every_block(runs):
    path, d = runs["mingpt"]
    c = d["culprit"]
    assert d["verdict"] == "culprit_found" and c["source"]["line"] == _line("softmax")
    assert d["diagnosis"]["cause"] == "softmax_all_masked"
    fix = d["diagnosis"]["fix"]  # a change to the masked_fill line, replayed in each of the three blocks
    assert fix["kind"] == "finite_mask_value" and "masked_fill" in fix["before"] and "finfo" in fix["after"]
    assert fix["verified"] is True, fix["verification"]


def test_resnet_snapshot_holds_the_running_stats_as_the_step_began(runs):
    path, d = runs["resnet"]
    snap = torch.load(path, weights_only=True)
    bufs = {k: v for k, v in snap["state"].items() if "running" in k}
    assert bufs and all(torch.isfinite(v).all() for v in bufs.values())  # the failing forward's NaN stats are not in
    assert snap["state"]["bn1.num_batches_tracked"].item() == 4  # four healthy steps before this one
    assert d["verdict"] == "nonfinite_input", d["verdict"]
    (row,) = [r for r in d["nonfinite_leaves"] if r["role"] == "input"]
    assert row["name"] == "images" and row["samples"] == [2]
    assert "images" in d["_terminal"] and "bad samples (dim 0): [2]" in d["_terminal"]
    assert "torch.isfinite(images)" in d["diagnosis"]["fix"]["code"]
