"""A GAT layer's attention softmax over each node's incoming edges, written as PyG's first `softmax` was:
exp of the raw scores divided by their per-node sum (torch_geometric.utils.scatter). A node with unnormalised
features (a large degree count) makes one score exceed 88: exp overflows, inf / inf = NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch_geometric.utils import scatter

CITE = "pyg-team/pytorch_geometric#53"
TITLE = "scatter softmax output 'nan' (GATConv: exp without subtracting the per-node max)"
STEPS, BAD_STEP = 6, 3
SRC = torch.tensor([0, 1, 2, 3, 4, 5, 1, 2, 0, 5, 3, 4])
DST = torch.tensor([1, 2, 3, 4, 5, 0, 0, 1, 2, 3, 4, 5])


class GATLayer(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.lin = nn.Linear(d, 16, bias=False)
        self.att = nn.Parameter(torch.randn(32) * 0.3)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        h = self.lin(x)
        scores = F.leaky_relu(torch.cat([h[SRC], h[DST]], -1) @ self.att, 0.2)
        e = scores.exp()  # CULPRIT
        alpha = e / scatter(e, DST, dim=0, dim_size=x.shape[0], reduce="sum")[DST]
        agg = scatter(alpha[:, None] * h[SRC], DST, dim=0, dim_size=x.shape[0], reduce="sum")
        return self.out(F.elu(agg)).squeeze(-1)


def build():
    torch.manual_seed(0)
    model = GATLayer()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 8, generator=g)
    if step == BAD_STEP:
        x[2] = -400.0 * x[2].sign()  # a raw count feature, not normalised, on one node
    return x, torch.randn(6, generator=g)


def loss_fn(pred, target):
    return F.mse_loss(pred, target)
