"""An optimal-transport loss by Sinkhorn iterations in the plain domain, K = exp(-C / eps). A target point far
from every prediction makes its column of K underflow to 0 (C / eps > 104): K^T u is 0, b / 0 = inf, and the
plan is 0 * inf = NaN. The exact remedy is the log-domain iteration with logsumexp."""
import torch
import torch.nn as nn

CITE = "PythonOT/POT#54"
TITLE = "Getting error while computing sinkhorn distance (numerical errors with a small reg)"
STEPS, BAD_STEP = 6, 3
EPS, ITERS = 0.05, 20


class PointDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 12))

    def forward(self, z):
        return self.mlp(z).view(-1, 6, 2)[0]


def build():
    model = PointDecoder()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    target = torch.randn(6, 2, generator=g) * 0.5
    if step == BAD_STEP:
        target[4] = torch.tensor([4.0, -4.0])  # an outlier point in the target cloud
    return torch.randn(1, 4, generator=g), target


def loss_fn(pred, target):
    C = ((pred[:, None] - target[None]) ** 2).sum(-1)
    K = torch.exp(-C / EPS)
    a = torch.full((6,), 1 / 6)
    b = torch.full((6,), 1 / 6)
    u, v = torch.ones(6), torch.ones(6)
    for _ in range(ITERS):
        u = a / (K @ v)
        v = b / (K.t() @ u)  # CULPRIT
    plan = u[:, None] * K * v[None]
    return (plan * C).sum()
