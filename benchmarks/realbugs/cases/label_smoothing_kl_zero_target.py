"""Label smoothing written by hand as KL(target || model), the annotated Transformer's smoothed distribution with
the padding column set to 0: target * (log(target) - log_probs) is 0 * (-inf) = NaN in that column, and the loss
is NaN from the first step (kl_div and xlogy define the term as 0 there)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "google-deepmind/optax#1786"
TITLE = "Keep kl_divergence finite when target probabilities are zero (one-hot targets, smoothing that keeps zeros)"
STEPS, BAD_STEP = 6, 0
V, PAD, SMOOTHING = 9, 0, 0.1


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.out = nn.Linear(16, V)

    def forward(self, tokens):
        return self.out(torch.tanh(self.emb(tokens)))


def build():
    model = Decoder()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, V, (4, 6), generator=g)
    return tokens, tokens.roll(1, dims=1)


def loss_fn(logits, y):
    log_probs = F.log_softmax(logits, dim=-1)
    target = torch.full_like(log_probs, SMOOTHING / (V - 2))
    target.scatter_(-1, y.unsqueeze(-1), 1 - SMOOTHING)
    target[..., PAD] = 0  # the padding token is never a target
    return (target * (torch.log(target) - log_probs)).sum(-1).mean()  # CULPRIT
