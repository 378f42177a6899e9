"""An entropy bonus from log-softmax: exp(logp) * logp is 0 * -inf = NaN for a masked (-inf) token."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "huggingface/trl#7221"
TITLE = "entropy_from_logits returns NaN for zero-probability tokens"
STEPS, BAD_STEP = 6, 3


def entropy_from_logits(logits):
    logps = F.log_softmax(logits, dim=-1)
    return -(torch.exp(logps) * logps).sum(-1)  # CULPRIT


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 6)

    def forward(self, x, allowed):
        return self.net(x).masked_fill(~allowed, float("-inf"))


def build():
    model = Policy()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=g)
    allowed = torch.ones(4, 6, dtype=torch.bool)
    if step == BAD_STEP:
        allowed[1, 4:] = False  # two actions illegal in this state
    return (x, allowed), torch.randint(0, 4, (4,), generator=g)


def loss_fn(logits, actions):
    logp = F.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    return -logp.mean() - 0.01 * entropy_from_logits(logits).mean()
