"""Label smoothing over logits masked with -inf: the smoothing term averages log_softmax over every class,
the masked ones included, so it is 0.1/C * (-inf) and the loss is inf. A batch of the task whose label set
is smaller (its other classes masked out) breaks; the other task's batches mask nothing. The chain holds only the
mask's literal -inf and its propagation (no Inf becomes NaN), so by the culprit's definition (DESIGN.md) the mask's
line is the culprit; the fix goes on the loss's line."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "facebookresearch/pytext#1698"
TITLE = "Label smoothing loss is -inf if any of the logits are -inf"
STEPS, BAD_STEP = 6, 3
ALLOWED = {"full": torch.ones(6, dtype=torch.bool), "small": torch.tensor([1, 1, 1, 0, 0, 0], dtype=torch.bool)}


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))

    def forward(self, x, allowed):
        logits = self.net(x)
        return logits.masked_fill(~allowed, float("-inf"))  # CULPRIT


def build():
    model = Tagger()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 8, generator=g)
    task = "small" if step == BAD_STEP else "full"
    y = torch.randint(0, 3 if task == "small" else 6, (8,), generator=g)
    return (x, ALLOWED[task]), y


def loss_fn(logits, y):
    return F.cross_entropy(logits, y, label_smoothing=0.1)
