"""Advantage normalisation (r - r.mean()) / r.std() on a batch of one episode: the unbiased std of one value is NaN."""
import torch
import torch.nn as nn

CITE = "pytorch/pytorch#29372"
TITLE = "torch.std() returns nan for single item tensors"
STEPS, BAD_STEP = 6, 3


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, obs, actions):
        logp = torch.log_softmax(self.net(obs), -1)
        return logp.gather(1, actions[:, None]).squeeze(1)


def build():
    model = Policy()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    n = 1 if step == BAD_STEP else 8  # the last, short rollout of an epoch: one episode
    obs = torch.randn(n, 4, generator=g)
    return (obs, torch.randint(0, 2, (n,), generator=g)), torch.randn(n, generator=g)


def loss_fn(logp, returns):
    adv = (returns - returns.mean()) / returns.std()  # CULPRIT
    return -(logp * adv).mean()
