"""Multi-label hashing loss that turns multi-hot labels into a target distribution by dividing each row by its
sum: an image with no label in the batch (an all-zero row) gives 0 / 0 = NaN in the target, and the
cross-entropy against it is NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "thaiminhpv/RelaHash#2"
TITLE = "if there are some zero vectors in the label matrix: NaN loss"
STEPS, BAD_STEP = 6, 3


class Hasher(nn.Module):
    def __init__(self):
        super().__init__()
        self.code = nn.Sequential(nn.Linear(12, 16), nn.Tanh())
        self.cls = nn.Linear(16, 5)

    def forward(self, x):
        return self.cls(self.code(x))


def build():
    model = Hasher()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 12, generator=g)
    labels = (torch.rand(8, 5, generator=g) < 0.4).float()
    labels[:, 0] = 1.0  # every sample has the first tag...
    if step == BAD_STEP:
        labels[6] = 0.0  # ...except an unlabelled image
    return x, labels


def loss_fn(logits, labels):
    log_p = F.log_softmax(logits, dim=1)
    labels_scaled = labels / labels.sum(dim=1, keepdim=True)  # CULPRIT
    return -(labels_scaled * log_p).sum(dim=1).mean()
