"""An ArcFace head trained on frozen face embeddings that takes the angle as acos(cosine) and adds the margin to
it: an embedding pointing exactly along its class centre (a near-duplicate of the centre's training image) gives a
cosine of 1 (or a rounding above it), and acos' derivative -1/sqrt(1 - c^2) is infinite there: NaN gradients."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "ronghuaiyang/arcface-pytorch#68"
TITLE = "About the range of cosine: when cosine(theta) == 1 the loss would become NaN"
STEPS, BAD_STEP = 6, 3
S, M = 16.0, 0.5


class ArcHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 10) * 0.1)

    def forward(self, x, label):
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        theta = torch.acos(cosine)  # CULPRIT
        target = torch.cos(theta + M)
        one_hot = F.one_hot(label, 6).float()
        return S * (one_hot * target + (1 - one_hot) * cosine)


def build():
    model = ArcHead()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch(step, model):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 10, generator=g)
    y = torch.randint(0, 6, (8,), generator=g)
    if step == BAD_STEP:
        x[5] = 2.0 * model.weight[y[5]].detach()  # an embedding exactly along its class centre
    return (x, y), y


loss_fn = F.cross_entropy
