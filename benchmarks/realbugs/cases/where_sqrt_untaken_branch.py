"""Edge lengths with the "safe" sqrt people write: torch.where(d2 > 0, d2.sqrt(), 0). Where two vertices
coincide the forward takes the 0 branch, but the sqrt branch is still differentiated: its backward at 0 is
inf, and the where sends it 0 * inf = NaN into the gradient (the "double where" trap)."""
import torch
import torch.nn as nn

CITE = "pytorch/pytorch#52248"
TITLE = "torch.where leads to unexpected gradients (NaN from the branch it did not take)"
STEPS, BAD_STEP = 6, 3
SRC = torch.tensor([0, 1, 2, 3, 1])
DST = torch.tensor([1, 2, 3, 0, 3])


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
        verts[3] = verts[1]  # a vertex stored twice at a seam: the edge 1-3 has length exactly 0
    return verts, torch.ones(len(SRC))


def loss_fn(verts, target):
    d2 = ((verts[SRC] - verts[DST]) ** 2).sum(-1)
    length = torch.where(d2 > 0, d2.sqrt(), torch.zeros_like(d2))  # CULPRIT
    return ((length - target) ** 2).mean()
