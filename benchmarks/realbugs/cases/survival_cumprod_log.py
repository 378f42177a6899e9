"""A discrete-time survival model (logistic hazard) whose survival curve is the cumulative product of 1 - hazard
over the intervals, and whose censored likelihood is log S(t) at the last observed interval: a subject followed
for two hundred intervals multiplies two hundred factors near 1/2, S underflows float32 to 0, and log(0) = -inf
(pycox computes it as log(1 - hazard).cumsum for this reason)."""
import torch
import torch.nn as nn

CITE = "havakv/pycox#51"
TITLE = "survival from hazards: (1 - hazard).log().cumsum(1).exp() rather than a cumulative product, for stability"
STEPS, BAD_STEP = 6, 3
K = 200  # intervals, padded


class LogisticHazard(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, K))

    def forward(self, x, followed):
        hazard = torch.sigmoid(self.fc(x)) * followed  # no hazard after the follow-up ends
        surv = torch.cumprod(1 - hazard, dim=1)
        return -torch.log(surv)  # CULPRIT


def build():
    model = LogisticHazard()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 6, generator=g)
    span = K if step == BAD_STEP else 40  # a subject followed for the whole study
    followed = torch.zeros(4, K)
    followed[:, :span] = 1.0
    last = torch.zeros(4, K)
    last[:, span - 1] = 1.0  # censored at the end of the follow-up: the likelihood is S(t_last)
    return (x, followed), last


def loss_fn(neg_log_surv, last):
    return (neg_log_surv * last).sum(1).mean()
