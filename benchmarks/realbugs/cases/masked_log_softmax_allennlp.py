"""allennlp's masked_log_softmax: vector + mask.log() is -inf everywhere on a row whose mask is all zeros."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "allenai/allennlp#890"
TITLE = "util.masked_log_softmax() returning NaN's"
STEPS, BAD_STEP = 6, 3


def masked_log_softmax(vector, mask):
    vector = vector + mask.float().log()  # CULPRIT
    return F.log_softmax(vector, dim=-1)


class Span(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(8, 1)

    def forward(self, h, mask):
        return masked_log_softmax(self.score(h).squeeze(-1), mask)


def build():
    model = Span()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch(step):
    g = torch.Generator().manual_seed(step)
    h = torch.randn(3, 6, 8, generator=g)
    mask = torch.ones(3, 6)
    mask[:, 5] = 0
    if step == BAD_STEP:
        mask[1] = 0  # a passage with no candidate span
    return (h, mask), torch.zeros(3, dtype=torch.long)


def loss_fn(logp, y):
    return F.nll_loss(logp, y)
