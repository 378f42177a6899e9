"""A speaker encoder (Real-Time-Voice-Cloning's) that L2-normalises its ReLU embedding by hand:
embeds_raw / torch.norm(embeds_raw, dim=1, keepdim=True). An utterance for which every ReLU unit is off gives an
all-zero embedding, its norm is 0, and 0 / 0 = NaN reaches every weight."""
import torch
import torch.nn as nn

CITE = "CorentinJ/Real-Time-Voice-Cloning#678"
TITLE = "Add epsilon term to norm of x for avoiding zero divided exception (NaN in the norm of embeddings)"
STEPS, BAD_STEP = 6, 3


class SpeakerEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.frames = nn.Linear(16, 16)
        self.linear = nn.Linear(16, 12)
        self.relu = nn.ReLU()

    def forward(self, utterances):  # [batch, frames, 16]
        hidden = self.frames(utterances).mean(1)
        embeds_raw = self.relu(self.linear(hidden))
        embeds = embeds_raw / torch.norm(embeds_raw, dim=1, keepdim=True)  # CULPRIT
        return embeds


def build():
    model = SpeakerEncoder()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step, model):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 5, 16, generator=g)
    target = nn.functional.normalize(torch.randn(6, 12, generator=g), dim=1)
    if step == BAD_STEP:  # an utterance (every frame the same) for which every ReLU unit is off
        with torch.no_grad():
            a = model.linear.weight @ model.frames.weight
            a0 = model.linear.weight @ model.frames.bias + model.linear.bias
            x[2] = torch.linalg.pinv(a) @ (-1.0 - a0)
    return x, target


def loss_fn(embeds, target):
    return ((embeds - target) ** 2).sum(1).mean()
