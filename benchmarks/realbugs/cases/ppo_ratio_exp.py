"""PPO's ratio exp(logp - old_logp) overflows when the policy has drifted far on one action."""
import torch
import torch.nn as nn

CITE = "THUDM/slime#2198"
TITLE = "fix(ppo): clamp log-ratios before exp()"
STEPS, BAD_STEP = 6, 3


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, obs, actions):
        return torch.log_softmax(self.net(obs), -1).gather(1, actions[:, None]).squeeze(1)


def build():
    model = Policy()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    obs = torch.randn(8, 4, generator=g)
    old_logp = torch.full((8,), -1.1)
    if step == BAD_STEP:
        old_logp[2] = -200.0  # a stale behaviour log-prob from an off-policy buffer
    return (obs, torch.randint(0, 3, (8,), generator=g)), (old_logp, torch.randn(8, generator=g))


def loss_fn(logp, target):
    old_logp, adv = target
    ratio = torch.exp(logp - old_logp)  # CULPRIT
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 0.8, 1.2) * adv
    return -torch.min(surr1, surr2).mean()
