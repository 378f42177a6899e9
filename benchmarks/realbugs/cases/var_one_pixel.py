"""EvoNorm's instance std: torch.var over a 1x1 feature map is NaN (unbiased, one value)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "digantamisra98/EvoNorm#5"
TITLE = "fix instance_std nan issue (torch.var of a single value)"
STEPS, BAD_STEP = 6, 3


def instance_std(x, eps=1e-5):
    var = torch.var(x, dim=(2, 3), keepdim=True)  # CULPRIT
    return torch.sqrt(var + eps)


class EvoNormS0(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.v = nn.Parameter(torch.ones(1, c, 1, 1))
        self.gamma = nn.Parameter(torch.ones(1, c, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, c, 1, 1))

    def forward(self, x):
        num = x * torch.sigmoid(self.v * x)
        return num / instance_std(x) * self.gamma + self.beta


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = EvoNormS0(8)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x)).mean((2, 3)))


def build():
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    size = 1 if step == BAD_STEP else 4  # a multi-scale loader's smallest scale: a 1x1 crop
    return torch.randn(2, 3, size, size, generator=g), torch.randint(0, 2, (2,), generator=g)


loss_fn = F.cross_entropy
