"""A spectral loss on the Fiedler vector of a learned graph Laplacian: torch.linalg.eigh's backward divides
by eigenvalue gaps. A graph whose edge features are all equal (a regular ring) has repeated eigenvalues,
the gap is 0 and the gradient is NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "pytorch/pytorch#47599"
TITLE = "Wrong grad of torch.symeig for degenerate eigenvalues (NaN/inf in the eigenvector backward)"
STEPS, BAD_STEP = 6, 3
SRC = torch.tensor([0, 1, 2, 3, 4])
DST = torch.tensor([1, 2, 3, 4, 0])


class EdgeWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, feats):
        w = F.softplus(self.lin(feats)).squeeze(-1)
        W = torch.zeros(5, 5).index_put((SRC, DST), w).index_put((DST, SRC), w, accumulate=True)
        return torch.diag(W.sum(1)) - W


def build():
    model = EdgeWeights()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    feats = torch.randn(5, 4, generator=g)
    if step == BAD_STEP:
        feats[:] = feats[0]  # every edge alike: a regular ring, whose Laplacian has repeated eigenvalues
    return feats, torch.randn(5, generator=g)


def loss_fn(lap, target):
    evals, evecs = torch.linalg.eigh(lap)  # CULPRIT
    return ((evecs[:, 1] ** 2 - target.softmax(0)) ** 2).sum() + evals[1]
