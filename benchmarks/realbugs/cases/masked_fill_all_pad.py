"""A transformer's attention with masked_fill(-inf): a sequence that is all padding masks a whole row."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "jadore801120/attention-is-all-you-need-pytorch#5"
TITLE = "nan loss when training (ScaledDotProductAttention sets masked values to -inf)"
STEPS, BAD_STEP = 6, 3
PAD = 0


class Encoder(nn.Module):
    def __init__(self, vocab=20, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 2)

    def forward(self, tokens):
        h = self.emb(tokens)
        q, k, v = self.qkv(h).chunk(3, -1)
        attn = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        mask = (tokens == PAD).unsqueeze(1)
        attn = attn.masked_fill(mask, float("-inf"))
        attn = F.softmax(attn, dim=-1)  # CULPRIT
        return self.out((attn @ v).mean(1))


def build():
    model = Encoder()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, 20, (4, 6), generator=g)
    tokens[:, 4:] = PAD
    if step == BAD_STEP:
        tokens[2] = PAD  # an empty sentence after filtering
    return tokens, torch.randint(0, 2, (4,), generator=g)


loss_fn = F.cross_entropy
