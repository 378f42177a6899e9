"""A causal mask written as -float('-inf'): the masked scores become +inf and the softmax of a row with +inf is NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "lucidrains/memory-compressed-attention#2"
TITLE = "The order of masking and softmax operation (mask value -float('-inf'))"
STEPS, BAD_STEP = 6, 0  # wrong from the first step


class CausalAttn(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 5)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        dots = q @ k.transpose(-2, -1)
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        dots = dots.masked_fill(mask, -float("-inf"))
        return self.out(F.softmax(dots, -1) @ v)  # CULPRIT


def build():
    model = CausalAttn()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, 4, 8, generator=g), torch.randint(0, 5, (2, 4), generator=g)


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, 5), y.reshape(-1))
