"""A DROP-style arithmetic head: the likelihood of the gold sign combination is the product over the passage's
numbers of each number's sign probability, and the loss is its log. A passage with a hundred numbers multiplies a
hundred probabilities near 1/3: the product underflows float32 to 0, log(0) = -inf, and the loss is inf."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "allenai/allennlp-reading-comprehension-research#5"
TITLE = "likelihood of a combination as a product of probabilities: not numerically stable, do it in log space"
STEPS, BAD_STEP = 6, 3
N = 100  # numbers per passage, padded


class SignHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, numbers, signs, mask):
        probs = F.softmax(self.fc(numbers), dim=-1)  # (batch, N, 3): minus, zero, plus
        gold = probs.gather(2, signs.unsqueeze(2)).squeeze(2)
        gold = gold * mask + (1 - mask)  # padded numbers count as probability 1
        likelihood = gold.prod(dim=1)
        return -torch.log(likelihood).mean()  # CULPRIT


def build():
    model = SignHead()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    numbers = torch.randn(4, N, 8, generator=g)
    signs = torch.randint(0, 3, (4, N), generator=g)
    count = N if step == BAD_STEP else 20  # a long passage: a hundred numbers
    mask = torch.zeros(4, N)
    mask[:, :count] = 1.0
    return (numbers, signs, mask), None


def loss_fn(out, _):
    return out
