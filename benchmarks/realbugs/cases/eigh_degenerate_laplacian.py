"""A spectral loss on the Fiedler vector of a learned graph Laplacian (graph structure learning: edge weights from
edge features). torch.linalg.eigh's backward divides by eigenvalue gaps. A batch whose edge features prune every
edge of two nodes (softplus underflows to 0) leaves them isolated: the eigenvalue 0 is then repeated exactly (their
zero rows), the gap is 0 and the gradient NaN. (Isolated nodes make the repetition exact on every CPU; a regular
ring's repeated eigenvalues are equal only as far as LAPACK's rounding lets them be.)"""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "pytorch/pytorch#47599"
TITLE = "Wrong grad of torch.symeig for degenerate eigenvalues (NaN/inf in the eigenvector backward)"
STEPS, BAD_STEP = 6, 3
SRC = torch.tensor([0, 1, 2, 3, 4, 0, 1])
DST = torch.tensor([1, 2, 3, 4, 5, 5, 3])


class GraphLearner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, feats):
        w = F.softplus(self.lin(feats)).squeeze(-1)
        W = torch.zeros(6, 6).index_put((SRC, DST), w).index_put((DST, SRC), w, accumulate=True)
        return torch.diag(W.sum(1)) - W


def build():
    model = GraphLearner()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step, model):
    g = torch.Generator().manual_seed(step)
    feats = torch.randn(7, 4, generator=g)
    if step == BAD_STEP:
        with torch.no_grad():
            feats[3:6] = -300.0 * model.lin.weight[0].sign()  # every edge of nodes 4 and 5 pruned
    return feats, torch.arange(6.0)


def loss_fn(lap, target):
    evals, evecs = torch.linalg.eigh(lap)  # CULPRIT
    return (evecs[:, 1] ** 2 * target).sum() + evals[1]
