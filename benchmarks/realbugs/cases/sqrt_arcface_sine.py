"""ArcFace's margin: sine = sqrt(1 - cos^2), where an embedding is exactly aligned with its class centre."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "ronghuaiyang/arcface-pytorch#91"
TITLE = "Request to avoid loss to NaN (sqrt of 1 - cosine^2 at cosine = 1)"
STEPS, BAD_STEP = 6, 3


class ArcMargin(nn.Module):
    def __init__(self, d=8, classes=4, s=16.0, m=0.3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, d))
        self.s, self.m = s, m

    def forward(self, x, label):
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        sine = torch.sqrt(1.0 - torch.pow(cosine, 2))  # CULPRIT
        phi = cosine * torch.cos(torch.tensor(self.m)) - sine * torch.sin(torch.tensor(self.m))
        one_hot = F.one_hot(label, cosine.shape[1]).to(cosine.dtype)
        return self.s * (one_hot * phi + (1.0 - one_hot) * cosine)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = ArcMargin()

    def forward(self, x, label):
        return self.head(x, label)


def build():
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step, model):
    g = torch.Generator().manual_seed(1000 + step)  # not the seed the weights were drawn with
    x = torch.randn(6, 8, generator=g)
    label = torch.randint(0, 4, (6,), generator=g)
    if step == BAD_STEP:  # embeddings exactly on their class centres (a collapsed encoder, duplicated samples)
        x[:] = model.head.weight.detach()[label] * torch.tensor([3.0, 0.5, 7.0, 1.0, 2.0, 5.0])[:, None]
    return (x, label), label


def loss_fn(logits, label):
    return F.cross_entropy(logits, label)


