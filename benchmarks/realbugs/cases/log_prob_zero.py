"""A policy-gradient loss on softmax probabilities: -log(pi[a]) where the policy put exactly 0 on the action."""
import torch
import torch.nn as nn

CITE = "awjuliani/DeepRL-Agents#34"
TITLE = "Solving NaN values (log(0) of a softmax policy)"
STEPS, BAD_STEP = 6, 3


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3), nn.Softmax(-1))

    def forward(self, obs):
        return self.net(obs)


def build():
    model = Policy()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step, model):
    g = torch.Generator().manual_seed(step)
    obs = torch.randn(8, 4, generator=g)
    actions = torch.randint(0, 3, (8,), generator=g)
    if step == BAD_STEP:
        obs[5] *= 1e4  # a sensor glitch; the behaviour policy (epsilon-greedy) took the action this one rules out
        with torch.no_grad():
            actions[5] = model(obs[5:6]).argmin()
    return obs, (actions, torch.randn(8, generator=g))


def loss_fn(policy, target):
    actions, adv = target
    responsible = policy.gather(1, actions[:, None]).squeeze(1)
    return -(torch.log(responsible) * adv).mean()  # CULPRIT
