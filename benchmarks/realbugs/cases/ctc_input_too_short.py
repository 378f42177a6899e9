"""CTC on captchas: a label longer than the model's output sequence can be aligned to (loss = inf)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "ypwhs/captcha_break#29"
TITLE = "ctc loss becomes nan (input_length too short for target_length)"
STEPS, BAD_STEP = 6, 3
T, C = 6, 10


class CRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 16, batch_first=False)
        self.fc = nn.Linear(16, C)

    def forward(self, x):
        h, _ = self.rnn(x)
        return F.log_softmax(self.fc(h), -1)


def build():
    model = CRNN()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(T, 3, 8, generator=g)
    lengths = torch.tensor([2, 2, 2])
    if step == BAD_STEP:
        lengths = torch.tensor([2, 5, 2])  # a long label with repeats: 5 labels need more than 6 frames
    targets = torch.randint(1, C, (3, 5), generator=g)
    if step == BAD_STEP:
        targets[1] = torch.tensor([3, 3, 3, 3, 3])
    return x, (targets, lengths)


def loss_fn(log_probs, target):
    targets, lengths = target
    input_lengths = torch.full((3,), T, dtype=torch.long)
    return F.ctc_loss(log_probs, targets, input_lengths, lengths)  # CULPRIT
