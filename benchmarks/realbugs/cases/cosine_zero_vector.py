"""Cosine similarity written by hand: (a * b).sum() / (|a| |b|) with an all-zero (padding) embedding is 0 / 0."""
import torch
import torch.nn as nn

CITE = "pytorch/pytorch#2421"
TITLE = "Gradient of zero norm is nan"
STEPS, BAD_STEP = 6, 3


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(30, 8, mode="sum", padding_idx=0)

    def forward(self, a, b):
        ea, eb = self.emb(a), self.emb(b)
        return (ea * eb).sum(-1) / (ea.norm(dim=-1) * eb.norm(dim=-1))  # CULPRIT


def build():
    model = Siamese()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    a = torch.randint(1, 30, (6, 4), generator=g)
    b = torch.randint(1, 30, (6, 4), generator=g)
    if step == BAD_STEP:
        b[2] = 0  # an empty document: every token is padding
    return (a, b), torch.ones(6)


def loss_fn(sim, y):
    return ((sim - y) ** 2).mean()
