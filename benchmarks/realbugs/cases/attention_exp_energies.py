"""Additive (Bahdanau) attention with the softmax over the energies written by hand, exp(e) / sum(exp(e)), with
no max subtracted: an input with a large activation makes an energy above ~88, exp overflows float32 to Inf,
and Inf / Inf = NaN."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "mila-iqia/blocks#727"
TITLE = "Stabilize attention energies (energies accumulate enough to make exp overflow: NaN in machine translation)"
STEPS, BAD_STEP = 6, 3


class AttentionClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.score = nn.Linear(16, 1)
        self.out = nn.Linear(8, 3)

    def forward(self, x):  # x: [batch, time, 8]
        energies = self.score(torch.relu(self.proj(x))).squeeze(-1)
        weights = torch.exp(energies) / torch.exp(energies).sum(1, keepdim=True)  # CULPRIT
        context = (weights.unsqueeze(-1) * x).sum(1)
        return self.out(context)


def build():
    model = AttentionClassifier()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step, model):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 5, 8, generator=g)
    if step == BAD_STEP:  # one frame of one sequence far along the direction the scorer rewards
        x[1, 2] = 0.0
        while True:
            with torch.no_grad():
                e = model.score(torch.relu(model.proj(x[1, 2])))
            if e.item() > 100:
                break
            x[1, 2] = x[1, 2] + torch.randn(8, generator=g) * 10
            with torch.no_grad():
                grad = torch.autograd.functional.jacobian(lambda v: model.score(torch.relu(model.proj(v))), x[1, 2])
            x[1, 2] = x[1, 2] + 20 * grad.flatten().sign()
    return x, torch.randint(0, 3, (4,), generator=g)


loss_fn = F.cross_entropy
