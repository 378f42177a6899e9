"""A trajectory head that predicts a 2x2 covariance entry by entry (two log-variances and a free off-diagonal term)
and scores it with the Gaussian NLL through torch.logdet: a sample whose predicted off-diagonal exceeds the
geometric mean of the variances gives a matrix with a negative determinant, logdet is NaN, and so is the loss."""
import torch
import torch.nn as nn

CITE = "stepankonev/waymo-motion-prediction-challenge-2022-multipath-plus-plus#9"
TITLE = "General loss function discussion: torch.logdet may create nan or inf"
STEPS, BAD_STEP = 6, 3


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.mu = nn.Linear(16, 2)
        self.cov = nn.Linear(16, 3)

    def forward(self, x):
        h = self.body(x)
        a, b, c = self.cov(h).unbind(1)
        cov = torch.stack([torch.stack([a.exp(), c], 1), torch.stack([c, b.exp()], 1)], 1)
        return self.mu(h), cov


def build():
    model = Head()
    with torch.no_grad():
        model.cov.weight.mul_(0.1)
        model.cov.bias.zero_()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g)
    if step == BAD_STEP:
        x[4] = 60.0 * x[4]  # an unnormalised sample: its off-diagonal term is large
    return x, torch.randn(8, 2, generator=g)


def loss_fn(out, y):
    mu, cov = out
    d = (y - mu).unsqueeze(2)
    maha = (d.transpose(1, 2) @ torch.linalg.inv(cov) @ d).squeeze()
    return (0.5 * torch.logdet(cov) + 0.5 * maha).mean()  # CULPRIT
