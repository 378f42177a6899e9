"""A speech separator trained with scale-invariant SDR: the projection of the estimate on the reference,
<est, ref> / ||ref||^2, is 0 / 0 for a clip whose reference is all zeros (a silent segment of the dataset)."""
import torch
import torch.nn as nn

CITE = "csteinmetz1/auraloss#25"
TITLE = "SDR loss sensitive to nan (SI-SDR of an all-zero target)"
STEPS, BAD_STEP = 6, 3


def build():
    model = nn.Sequential(nn.Conv1d(1, 8, 9, padding=4), nn.Tanh(), nn.Conv1d(8, 1, 9, padding=4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    clean = torch.randn(4, 1, 256, generator=g) * 0.3
    if step == BAD_STEP:
        clean[2] = 0.0  # a silent segment: the reference is all zeros
    noisy = clean + 0.1 * torch.randn(4, 1, 256, generator=g)
    return noisy, clean


def loss_fn(est, ref):
    est, ref = est.squeeze(1), ref.squeeze(1)
    alpha = (est * ref).sum(-1, keepdim=True) / (ref ** 2).sum(-1, keepdim=True)  # CULPRIT
    target = alpha * ref
    noise = est - target
    sdr = 10 * torch.log10((target ** 2).sum(-1) / (noise ** 2).sum(-1))
    return -sdr.mean()
