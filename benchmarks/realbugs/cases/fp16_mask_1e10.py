"""GPT-2's attention mask w * b - 1e10 * (1 - b) with the 1e10 kept as a buffer: model.half() makes it Inf in
float16, and Inf * 0 on every unmasked position is NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "openai/gpt-2#122"
TITLE = "Update mask_attn_weights to work with mixed precision training"
STEPS, BAD_STEP = 6, 0  # broken from the first half-precision step


class Block(nn.Module):
    def __init__(self, d=16, t=6):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, 8)
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, t, t))
        self.register_buffer("masked_bias", torch.tensor(1e10))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        w = q @ k.transpose(-2, -1) * 0.25
        b = self.bias[:, : w.shape[-2], : w.shape[-1]].to(w.dtype)
        w = w * b - self.masked_bias * (1 - b)  # CULPRIT
        return self.head(F.softmax(w, -1) @ v).float()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)


def build():
    model = Net().half()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2, 6, 16, generator=g)
    return x.half(), torch.randint(0, 8, (2, 6), generator=g)


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, 8), y.reshape(-1))
