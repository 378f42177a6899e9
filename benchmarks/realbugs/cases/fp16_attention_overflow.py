"""Attention in half precision: q @ k^T overflows float16 (max 65504) and the softmax of an Inf row is NaN."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "pytorch/pytorch#40497"
TITLE = "Mixed precision causes NaN loss (attention matmul overflows in fp16)"
STEPS, BAD_STEP = 6, 3


class Attn(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # CULPRIT
        p = F.softmax(scores, dim=-1)
        return self.out((p @ v).mean(1)).float()


def build():
    model = Attn().half()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2, 5, 16, generator=g)
    if step == BAD_STEP:
        x[1] *= 400.0  # activations from an unnormalised feature
    return x.half(), torch.randint(0, 2, (2,), generator=g)


loss_fn = F.cross_entropy
