"""Training loops whose gradients die or are cut, one per family (run as a script by tests/flow/test_flow.py, in a
folder of its own: the analysis runs where this file cannot be imported). Each blamed line ends in `# CULPRIT`."""

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nanreplay import NanGuard


class SkipDetach(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h.detach() + self.block(h.detach())  # CULPRIT
        return self.out(h)


class ArgmaxRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.Parameter(torch.randn(4, 8, 1) * 0.3)

    def forward(self, x):
        choice = self.router(x).argmax(-1)  # CULPRIT
        w = self.experts[choice]  # each sample's expert (every expert routed on this batch)
        return torch.bmm(x.unsqueeze(1), w).squeeze(1)


class SigmoidGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.value = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.gate.weight.mul_(0.01)
            self.gate.bias.fill_(40.0)  # saturated from the start: sigmoid(40) is exactly 1.0 in float32

    def forward(self, x):
        g = torch.sigmoid(self.gate(x))  # CULPRIT
        return self.head(g * self.value(x))


class NoGradHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 1)

    def features(self, x):
        with torch.no_grad():
            return torch.relu(self.proj(x))  # CULPRIT

    def forward(self, x):
        return self.head(self.features(x))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 32)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, idx):
        return self.lm_head(torch.tanh(self.body(self.embed(idx))))


class OwnCheckpoint(nn.Module):
    """A user's own reentrant checkpoint after a frozen input projection."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.embed.requires_grad_(False)

    def forward(self, x):
        h = self.embed(x)
        h = checkpoint(self.block, h, use_reentrant=True)  # CKPT
        return self.head(h)


class Quantized(nn.Module):
    """Fake quantisation with no straight-through estimator: round() has a zero derivative at every value, and the
    loss still depends on the encoder's values (in steps)."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.dec(torch.round(self.enc(x) * 4) / 4)  # ROUND


class DataCut(nn.Module):
    """A custom layer that reads the weight's `.data` in the middle of the model."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(F.linear(h, self.fc2.weight.data, self.fc2.bias))  # DATA
        return self.out(h)


class SaturatedRNN(nn.Module):
    """A tanh RNN with a bad init (a recurrent bias of 20): every state saturates at exactly 1.0, and the loss reads
    the last one only, through the `stack` of all the states."""

    def __init__(self):
        super().__init__()
        self.rnn, self.out = nn.RNN(8, 16, batch_first=True), nn.Linear(16, 1)
        with torch.no_grad():
            self.rnn.bias_hh_l0.fill_(20.0)

    def forward(self, x):
        h, _ = self.rnn(x.unsqueeze(1).expand(-1, 40, -1))  # RNN
        return self.out(h[:, -1])


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))  # RELU
        return self.out(h)


def dead_relu():
    return MLP()


def loop(model, folder, steps, *, lr=1e-2, lr_at=None, tokens=False):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    loss_fn = F.cross_entropy if tokens else F.mse_loss
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder)
    for step in range(steps):
        if tokens:
            x, y = torch.randint(0, 32, (8,)), torch.randint(0, 32, (8,))
        else:
            x, y = torch.randn(32, 8), torch.randn(32, 1) + 3
        for g in opt.param_groups:
            g["lr"] = (lr_at or {}).get(step, lr)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        guard.loss_ok(loss)
        loss.backward()
        guard.grads_ok()
        opt.step()
    return guard


def mse_step(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)  # CULPRIT: [B, 1] against [B] broadcasts to [B, B]


def broadcast_mse(folder):
    """A healthy-looking regression whose loss broadcasts; its batch at step 2 holds a NaN (a snapshot to analyze)."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, step_fn=mse_step, folder=folder)
    for step in range(3):
        x, y = torch.randn(8, 4), torch.randn(8)
        if step == 2:
            x[1, 2] = float("nan")
        guard.begin((x, y), step=step)
        opt.zero_grad()
        loss = mse_step(model, (x, y))
        if not guard.loss_ok(loss):
            break
        loss.backward()
        guard.grads_ok()
        opt.step()
    return guard


def broadcast_healthy(folder):
    """The same broadcasting loss on healthy steps: a snapshot of a finite step (as a user would save one by hand)."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, step_fn=mse_step, folder=folder)
    for step in range(2):
        x, y = torch.randn(8, 4), torch.randn(8)
        guard.begin((x, y), step=step)
        opt.zero_grad()
        loss = mse_step(model, (x, y))
        guard.loss_ok(loss)
        loss.backward()
        guard.grads_ok()
        if step == 1:
            Path(folder).mkdir(parents=True, exist_ok=True)
            torch.save(guard.to_dict("loss"), f"{folder}/healthy.pt")
        opt.step()
    return f"{folder}/healthy.pt"


def swiftformer(folder):
    """transformers' SwiftFormer, tiny: its additive attention's softmax runs over a dimension of size 1."""
    from transformers import SwiftFormerConfig, SwiftFormerForImageClassification

    cfg = SwiftFormerConfig(depths=(1, 1, 1, 1), embed_dims=(8, 8, 16, 16), num_labels=3, image_size=32)
    model = SwiftFormerForImageClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step_fn(m, batch):
        return m(pixel_values=batch[0], labels=batch[1]).loss

    # w_g is inert (the loss does not depend on it): a warning by default; {"inert": True} writes the snapshot
    guard = NanGuard(model, opt, step_fn=step_fn, folder=folder, check_flow={"inert": True})
    for step in range(4):
        batch = (torch.randn(2, 3, 32, 32), torch.randint(0, 3, (2,)))
        guard.begin(batch, step=step)
        opt.zero_grad()
        loss = step_fn(model, batch)
        loss.backward()  # before loss_ok(): its first-step re-run breaks this model's backward (a guard bug, #36)
        guard.loss_ok(loss)
        guard.grads_ok()
        opt.step()
    return guard


def vit_reentrant(folder):
    """transformers#21381: reentrant gradient checkpointing with frozen embeddings: no input of a checkpointed layer
    needs a gradient, so no encoder layer gets one (transformers repairs this itself for input_ids models only)."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=32, num_labels=3)
    model = ViTForImageClassification(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.vit.embeddings.requires_grad_(False)  # frozen patch embeddings
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step_fn(m, batch):
        return m(pixel_values=batch[0], labels=batch[1]).loss

    guard = NanGuard(model, opt, step_fn=step_fn, folder=folder)
    for step in range(2):
        batch = (torch.randn(2, 3, 16, 16), torch.randint(0, 3, (2,)))
        guard.begin(batch, step=step)
        opt.zero_grad()
        loss = step_fn(model, batch)
        guard.loss_ok(loss)
        loss.backward()
        guard.grads_ok()
        opt.step()
    return guard


def bert_tied_frozen(folder):
    """transformers' BERT masked LM, tiny, with the token embeddings frozen: its MLM decoder's weight is the same
    tensor (tied), so the decoder stops learning too while its bias trains on."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=16)
    model = BertForMaskedLM(cfg)
    model.bert.embeddings.word_embeddings.requires_grad_(False)  # meant: freeze the input embeddings only
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step_fn(m, batch):
        return m(input_ids=batch[0], labels=batch[1]).loss

    guard = NanGuard(model, opt, step_fn=step_fn, folder=folder)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 8))
        guard.begin((ids, ids), step=step)
        opt.zero_grad()
        loss = step_fn(model, (ids, ids))
        guard.loss_ok(loss)
        loss.backward()
        guard.grads_ok()
        opt.step()
    return guard


def main(root, kinds):
    for kind in kinds:
        torch.manual_seed(1 if kind == "skip_detach_again" else 0)
        if kind == "broadcast_healthy":
            print(kind, broadcast_healthy(f"{root}/{kind}"))
            continue
        if kind == "broadcast_mse":
            g = broadcast_mse(f"{root}/{kind}")
            print(kind, g.snapshots[0] if g.snapshots else "none")
            continue
        if kind in ("swiftformer", "vit_reentrant", "bert_tied_frozen"):
            g = {"swiftformer": swiftformer, "vit_reentrant": vit_reentrant,
                 "bert_tied_frozen": bert_tied_frozen}[kind](f"{root}/{kind}")
            print(kind, g.flow_snapshots[0] if g.flow_snapshots else "none", g.snapshots)
            continue
        if kind == "dead_relu":
            g = loop(dead_relu(), f"{root}/{kind}", 11, lr_at={4: 30.0})  # one step at lr 30 kills the units
        elif kind == "dead_init":
            m = MLP()
            with torch.no_grad():
                m.fc2.bias.fill_(-20.0)  # a bad init: every unit of the second layer dead from the first step
            g = loop(m, f"{root}/{kind}", 5)
        elif kind == "tied_frozen":
            m = TiedLM()
            m.embed.weight.requires_grad_(False)  # meant: freeze the embeddings; it freezes the tied head too
            g = loop(m, f"{root}/{kind}", 2, tokens=True)
        else:
            model = {"skip_detach": SkipDetach, "skip_detach_again": SkipDetach, "argmax_router": ArgmaxRouter,
                     "sigmoid_gate": SigmoidGate, "no_grad_helper": NoGradHelper,
                     "own_reentrant": OwnCheckpoint, "round_path": Quantized, "data_cut": DataCut,
                     "rnn_saturated": SaturatedRNN}[kind]()
            g = loop(model, f"{root}/{kind}", 4)
        print(kind, g.flow_snapshots[0] if g.flow_snapshots else "none", g.snapshots)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
