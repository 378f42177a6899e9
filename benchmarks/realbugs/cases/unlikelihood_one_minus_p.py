"""Sequence-level unlikelihood training (Welleck et al.) written without the reference code's clamp: the penalty
-log(1 - p) on the model's own repeated greedy tokens, with p = exp(log_softmax(...)). A context that makes the
model certain of its token gives log p = 0 exactly, p = 1.0, and log(1 - p) = log(0) = -Inf (and 0 * Inf = NaN
where the repeat mask is 0)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "facebookresearch/unlikelihood_training#10"
TITLE = "sequence-level unlikelihood loss: one_minus_probs = clamp(1 - pred_lprobs.exp(), min=1e-20); -log(one_minus_probs)"
STEPS, BAD_STEP = 6, 3


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.Linear(8, 16)
        self.out = nn.Linear(16, 12)

    def forward(self, ctx, mask):
        logits = self.out(F.relu(self.h(ctx)))
        pred_toks = logits.argmax(-1, keepdim=True)  # the model's own greedy continuation
        lprobs = F.log_softmax(logits, dim=-1)
        pred_lprobs = lprobs.gather(1, pred_toks).squeeze(1)
        one_minus_probs = 1.0 - pred_lprobs.exp()
        return -torch.log(one_minus_probs) * mask  # CULPRIT


def build():
    model = TinyLM()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    ctx = torch.randn(8, 8, generator=g)
    mask = (torch.rand(8, generator=g) < 0.5).float()  # the tokens that repeat an earlier n-gram
    if step == BAD_STEP:
        ctx[5] *= 1e3  # a context the model is certain about
    return (ctx, mask), None


def loss_fn(loss, _):
    return loss.sum() / loss.numel()
