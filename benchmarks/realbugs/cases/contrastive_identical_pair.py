"""A siamese network's contrastive loss with the distance taken as sqrt of the squared distance: a pair of two
identical samples (a duplicate in the dataset) has distance exactly 0, and sqrt's derivative there is Inf; the
NaN reaches every weight."""
import torch
import torch.nn as nn

CITE = "adambielski/siamese-triplet#18"
TITLE = "Siamese loss problem (the derivative of sqrt(d) is NaN when a distance is 0: two identical samples)"
STEPS, BAD_STEP = 6, 3
MARGIN = 1.0


class EmbeddingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.PReLU(), nn.Linear(16, 2))

    def forward(self, x1, x2):
        return self.net(x1), self.net(x2)


def build():
    model = EmbeddingNet()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x1, x2 = torch.randn(8, 10, generator=g), torch.randn(8, 10, generator=g)
    target = (torch.arange(8) % 2).float()  # 1: same class, 0: different classes
    if step == BAD_STEP:
        x2[3] = x1[3]  # a duplicated image, paired with itself as a negative
    return (x1, x2), target


def loss_fn(out, target):
    output1, output2 = out
    distances = (output2 - output1).pow(2).sum(1)  # squared distances
    losses = 0.5 * (target * distances +
                    (1 - target) * torch.relu(MARGIN - distances.sqrt()).pow(2))  # CULPRIT
    return losses.mean()
