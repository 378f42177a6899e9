"""A mesh edge-length loss: sqrt of the squared length of an edge whose two vertices coincide (a seam vertex
duplicated in the mesh gets the same displacement, so the edge has length exactly 0)."""
import torch
import torch.nn as nn

CITE = "akanazawa/cmr#11"
TITLE = "triangle_loss_fn returns nan (the gradient of sqrt at 0)"
STEPS, BAD_STEP = 6, 3
EDGES = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [1, 3]])


class Deform(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, verts):
        return verts + self.mlp(verts)


def build():
    model = Deform()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    verts = torch.randn(4, 3, generator=g)
    if step == BAD_STEP:
        verts[2] = verts[1]  # a seam vertex stored twice
    return verts, torch.ones(len(EDGES))


def loss_fn(verts, target):
    e = verts[EDGES[:, 0]] - verts[EDGES[:, 1]]
    length = torch.sqrt((e ** 2).sum(-1))  # CULPRIT
    return ((length - target) ** 2).mean()
