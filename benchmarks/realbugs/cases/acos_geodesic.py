"""A geodesic rotation loss: acos((trace(R1 R2^T) - 1) / 2) without a clamp; equal rotations give cos a hair above 1."""
import torch
import torch.nn as nn

CITE = "papagina/RotationContinuity#1"
TITLE = "Geodesic distance between rotation matrices: torch.acos returns nan outside [-1, 1]"
STEPS, BAD_STEP = 6, 3


def rot6d(x):
    a, b = x[:, :3], x[:, 3:]
    a = a / a.norm(dim=-1, keepdim=True)
    b = b - (a * b).sum(-1, keepdim=True) * a
    b = b / b.norm(dim=-1, keepdim=True)
    return torch.stack([a, b, torch.cross(a, b, dim=-1)], -1)


def geodesic(m1, m2):
    m = m1 @ m2.transpose(1, 2)
    cos = (m[:, 0, 0] + m[:, 1, 1] + m[:, 2, 2] - 1) / 2
    return torch.acos(cos)  # CULPRIT


class Pose(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 6))

    def forward(self, x):
        return rot6d(x + self.net(x))


def build():
    model = Pose()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step, model):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g)
    with torch.no_grad():
        target = rot6d(torch.randn(8, 6, generator=g))
        if step == BAD_STEP:
            target[:4] = model(x)[:4]  # the prediction is exactly right on these samples
    return x, target


def loss_fn(pred, target):
    return geodesic(pred, target).mean()
