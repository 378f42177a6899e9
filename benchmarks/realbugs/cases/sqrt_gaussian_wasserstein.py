"""mmrotate's Gaussian Wasserstein distance: sqrt of the distance between two equal Gaussians (a prediction that
matches its box exactly) has an infinite gradient."""
import torch
import torch.nn as nn

CITE = "open-mmlab/mmrotate#205"
TITLE = "[BUG] Gaussian distance/divergence losses grad nan issue"
STEPS, BAD_STEP = 6, 3


def gwd_loss(pred, target):
    xy_p, wh_p = pred[:, :2], pred[:, 2:].exp()
    xy_t, wh_t = target[:, :2], target[:, 2:].exp()
    xy_distance = (xy_p - xy_t).square().sum(-1)
    whr_distance = (wh_p.sqrt() - wh_t.sqrt()).square().sum(-1)
    distance = torch.sqrt(xy_distance + whr_distance)  # CULPRIT
    return torch.log1p(distance).mean()


def build():
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step, model):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    with torch.no_grad():
        t = torch.randn(8, 4, generator=g) * 0.1
        if step == BAD_STEP:
            t[2] = model(x)[2]  # a prediction exactly on its box
    return x, t


loss_fn = gwd_loss
