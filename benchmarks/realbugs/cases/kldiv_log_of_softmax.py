"""Label smoothing with nn.KLDivLoss on log(probabilities): a softmax that underflows to exactly 0 on a class the
smoothed target still gives mass to makes the input -inf and the loss +inf (the Annotated Transformer's example)."""
import torch
import torch.nn as nn

CITE = "harvardnlp/annotated-transformer#109"
TITLE = "label smoothing inf err (KLDivLoss on log of a probability that is 0)"
STEPS, BAD_STEP = 6, 3
CLASSES, SMOOTHING = 6, 0.1


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, CLASSES))

    def forward(self, x):
        return torch.softmax(self.net(x), -1)


def build():
    model = Classifier()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 8, generator=g)
    if step == BAD_STEP:
        x[4] *= 400.0  # an unscaled sample: its logits are hundreds apart
    return x, torch.randint(0, CLASSES, (8,), generator=g)


def loss_fn(probs, labels):
    true_dist = torch.full_like(probs, SMOOTHING / (CLASSES - 1))
    true_dist.scatter_(1, labels[:, None], 1.0 - SMOOTHING)
    return nn.KLDivLoss(reduction="batchmean")(torch.log(probs), true_dist)  # CULPRIT
