"""Language-model loss with ignore_index: a batch whose labels are all -100 (prompt only) averages over zero tokens."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "pytorch/pytorch#70348"
TITLE = "nan returned by nn.CrossEntropyLoss when all the labels are ignore_index"
STEPS, BAD_STEP = 6, 3


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.emb(ids))


def build():
    model = LM()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 16, (2, 6), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    if step == BAD_STEP:
        labels[:] = -100  # the answers were truncated away: only prompt tokens left
    return ids, labels


def loss_fn(logits, labels):
    return F.cross_entropy(logits.view(-1, 16), labels.view(-1), ignore_index=-100)  # CULPRIT
