"""The reference mid-size transformer the benchmarks use (4 layers, d=384, seq 256, batch 16).

`nan_layer=k` plants a realistic NaN deep inside: block k computes an unguarded
entropy-style term p * log(p) on a ReLU gate, so the forward pass goes NaN there
and everything after it — the rest of forward and all of backward — carries it.

`grad_layer=k` plants a gradient-only failure instead: block k adds a hand-written
pairwise distance sqrt(sum((a - b)^2)) between its tokens, which is 0 from each token
to itself — a finite forward and loss, and 0/0 = NaN in backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, LAYERS, HEADS, SEQ, BATCH = 1000, 384, 4, 6, 256, 16


class Block(nn.Module):
    def __init__(self, d: int, heads: int, nan: bool = False, grad_nan: bool = False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads
        self.nan = nan
        self.grad_nan = grad_nan

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        h = F.gelu(self.fc1(self.ln2(x)))
        if self.nan:
            gate = F.relu(h[..., :8])
            h = h + (gate * torch.log(gate)).sum(-1, keepdim=True)  # 0 * log(0) = NaN
        if self.grad_nan:
            g = h[..., :8]
            dist = ((g[:, :, None] - g[:, None, :]) ** 2).sum(-1).sqrt()  # 0 on the diagonal: d sqrt = 1/0
            h = h + 1e-3 * dist.mean(-1, keepdim=True)
        return x + self.fc2(h)


class Transformer(nn.Module):
    def __init__(self, layers: int = LAYERS, d: int = D, heads: int = HEADS, nan_layer: int | None = None,
                 grad_layer: int | None = None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(SEQ, d))
        self.blocks = nn.ModuleList([Block(d, heads, nan=(i == nan_layer), grad_nan=(i == grad_layer)) for i in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def batch(batch_size: int = BATCH, seq: int = SEQ, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    return idx, torch.randint(0, VOCAB, (batch_size, seq), generator=g)


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def build_nan() -> nn.Module:
    """Factory for `--model benchmarks.transformer:build_nan`."""
    torch.manual_seed(0)
    return Transformer(nan_layer=LAYERS - 2)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Transformer()


class LogHead(Transformer):
    """The seed's plain-dict case at the reference size: the head returns log(softmax(logits)), and its weights
    have grown so that softmax underflows to exact 0 for most classes. With confident targets the loss stays finite;
    backward through log at 0 makes the gradients NaN."""

    def forward(self, idx):
        return torch.log(torch.softmax(super().forward(idx), dim=-1))


def build_log_head() -> nn.Module:
    """Factory for `--model benchmarks.transformer:build_log_head` (the weights come from the snapshot)."""
    torch.manual_seed(0)
    return LogHead()


def log_head_snapshot(batch_size: int = BATCH) -> dict:
    """The plain dict the seed's "cheap NaN insurance" writes, {'x', 'y', 'state'}, for `build_log_head`."""
    model = build_log_head()
    with torch.no_grad():
        model.head.weight.mul_(60)  # confident logits: softmax underflows to exact 0
        idx, _ = batch(batch_size)
        y = model(idx).argmax(-1)  # the confident classes: a finite loss
    return {"x": idx, "y": y, "state": model.state_dict()}


def nll(log_probs, target):
    """`--loss benchmarks.transformer:nll`: the loss for `build_log_head`'s log-probabilities."""
    return F.nll_loss(log_probs.flatten(0, 1), target.flatten())
