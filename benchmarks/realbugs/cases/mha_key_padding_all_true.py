"""nn.MultiheadAttention with a key_padding_mask whose row is all True (a sequence that is all padding): the
masked scores are -inf for every key, softmax is 0/0 and the NaN reaches every parameter's gradient."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "pytorch/pytorch#40932"
TITLE = "MultiheadAttention set(-inf) cause 'Nan' in loss computing (key_padding_mask full of True)"
STEPS, BAD_STEP = 6, 3
PAD = 0


class Encoder(nn.Module):
    def __init__(self, vocab=20, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.out = nn.Linear(d, 2)

    def forward(self, tokens):
        h = self.emb(tokens)
        pad = tokens == PAD
        h, _ = self.attn(h, h, h, key_padding_mask=pad)  # CULPRIT
        return self.out(h.mean(1))


def build():
    model = Encoder()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, 20, (4, 6), generator=g)
    tokens[:, 4:] = PAD
    if step == BAD_STEP:
        tokens[1] = PAD  # an utterance that was empty after filtering
    return tokens, torch.randint(0, 2, (4,), generator=g)


loss_fn = F.cross_entropy
