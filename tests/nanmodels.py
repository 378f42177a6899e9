"""Purpose-built models, one per NaN/Inf cause (torchinfo's fixtures style).

Every case (see `cases.py`) is a zero-argument model factory of this module (what
`--model nanmodels:FACTORY` names), a batch, an optional loss spec, and the expected
culprit. The line that should be blamed carries a `# CULPRIT: <case>` marker; tests
look it up with `CASES.marker_line`, so the expectation never drifts from the code.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases import Registry, seeded

CASES = Registry(__name__)
case = CASES.case


# ---------------------------------------------------------------- sqrt(0): Inf in backward, then 0*Inf


class PairDistance(nn.Module):
    def forward(self, a, b):
        return ((a - b) ** 2).sum(-1).sqrt()  # CULPRIT: sqrt_zero


class Siamese(nn.Module):
    """Distance between two embeddings; identical inputs make the distance exactly 0."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.dist = PairDistance()

    def forward(self, a, b):
        return self.dist(self.encoder(a), self.encoder(b)).mean()


def _pair():
    torch.manual_seed(1)
    a = torch.randn(4, 6)
    b = a.clone()
    b[:2] += torch.randn(2, 6)  # rows 2 and 3 stay identical
    return {"x": (a, b)}


@case("sqrt_zero", _pair, phase="backward", kind="inf", op="aten.div.Tensor", forward_op="aten.sqrt.default",
      backward_node="SqrtBackward0", module="dist", anomaly=True, agrees=False)
@seeded
def siamese():
    return Siamese()


# ---------------------------------------------------------------- the seed's Inf trap: finite loss, Inf gradient


class Gain(nn.Module):
    """A learned per-feature gain, applied as sqrt(g) — g starts at 0 for a pruned feature."""

    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.tensor([1.0, 0.0, 2.0, 0.5]))

    def forward(self, x):
        return (x * self.g.sqrt()).sum()  # CULPRIT: inf_trap


def _pos_batch():
    torch.manual_seed(2)
    return {"x": torch.rand(3, 4) + 0.1}


@case("inf_trap", _pos_batch, phase="backward", kind="inf", op="aten.div.Tensor", forward_op="aten.sqrt.default",
      backward_node="SqrtBackward0", module="", anomaly=False, failure="gradient")
@seeded
def gain():
    return Gain()


# ---------------------------------------------------------------- log(0) -> -inf in forward


class LogLikelihood(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        p = F.relu(self.fc(x))
        return -torch.log(p).mean()  # CULPRIT: log_zero


def _relu_zero_batch():
    torch.manual_seed(3)
    return {"x": torch.randn(8, 4)}


@case("log_zero", _relu_zero_batch, phase="forward", kind="inf", op="aten.log.default",
      forward_op="aten.log.default", module="")
@seeded
def log_likelihood():
    return LogLikelihood()


# ---------------------------------------------------------------- sqrt(-1), log(-1): NaN in forward


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).sqrt()  # CULPRIT: sqrt_neg


class WithScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.ModuleDict({"scale": Scale()})
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block["scale"](x))


def _target2():
    b = _relu_zero_batch()
    b["y"] = torch.zeros(8, 2)
    return b


@case("sqrt_neg", _target2, loss="mse_loss", phase="forward", kind="nan", op="aten.sqrt.default",
      forward_op="aten.sqrt.default", module="block.scale", anomaly=True, agrees=False)
@seeded
def with_scale():
    return WithScale()


class LogNeg(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return torch.log(self.fc(x)).mean()  # CULPRIT: log_neg


@case("log_neg", _relu_zero_batch, phase="forward", kind="nan", op="aten.log.default", forward_op="aten.log.default",
      module="", anomaly=False)
@seeded
def log_neg():
    return LogNeg()


# ---------------------------------------------------------------- 0/0: normalising a zero vector


class Normalize(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 4, bias=False)

    def forward(self, x):
        h = self.embed(x)
        return h / h.norm(dim=-1, keepdim=True)  # CULPRIT: zero_norm


class Retrieval(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = Normalize()

    def forward(self, x):
        return self.query(x).sum()


def _zero_rows():
    torch.manual_seed(4)
    x = torch.randn(6, 5)
    x[3] = 0  # an empty (all-zero) feature row
    return {"x": x}


@case("zero_norm", _zero_rows, phase="forward", kind="nan", op="aten.div.Tensor", forward_op="aten.div.Tensor",
      module="query", anomaly=True, agrees=True)
@seeded
def retrieval():
    return Retrieval()


# ---------------------------------------------------------------- 0 * log(0)


class Entropy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        p = F.relu(self.fc(x))
        p = p / (p.sum(-1, keepdim=True) + 1)
        return -(p * torch.log(p)).sum(-1).mean()  # CULPRIT: zero_log_zero


@case("zero_log_zero", _relu_zero_batch, phase="forward", kind="inf", op="aten.log.default",
      forward_op="aten.log.default", module="", failure="loss")
@seeded
def entropy():
    return Entropy()


# ---------------------------------------------------------------- log(softmax(x)) collapse: NaN in backward


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        with torch.no_grad():
            self.fc.weight.mul_(60)  # confident logits: softmax underflows to exact 0

    def forward(self, x):
        return torch.log(torch.softmax(self.fc(x), dim=-1))  # CULPRIT: log_softmax


def _cls_batch():
    torch.manual_seed(5)
    x = torch.randn(8, 4)
    with torch.no_grad():
        torch.manual_seed(0)
        logits = seeded(lambda: Classifier())().fc(x)
    return {"x": x, "y": logits.argmax(-1)}  # targets are the confident classes: the loss stays finite


@case("log_softmax", _cls_batch, loss="nll_loss", phase="backward", kind="nan", op="aten.div.Tensor",
      forward_op="aten.log.default", backward_node="LogBackward0", module="", failure="gradient",
      anomaly=True, agrees=True)
@seeded
def classifier():
    return Classifier()


def classifier_step() -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The log_softmax case's (x, y, state_dict), for tests that lay out a snapshot dict of their own."""
    b = CASES["log_softmax"].batch()
    return b["x"], b["y"], classifier().state_dict()


# ---------------------------------------------------------------- fp16 overflow in a matmul


class HalfMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 1)
        with torch.no_grad():
            self.fc1.weight.fill_(40.0)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).float().mean()  # CULPRIT: fp16


def _half_batch():
    return {"x": torch.full((4, 16), 120.0).half()}


@case("fp16", _half_batch, phase="forward", kind="inf", op="aten.addmm.default", forward_op="aten.addmm.default",
      module="fc1")
def half_mlp():
    torch.manual_seed(0)
    return HalfMLP().half()


# ---------------------------------------------------------------- attention masks


class Attention(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, x, pad):
        T = x.shape[1]
        s = self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(x.shape[-1])
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        s = s.masked_fill(causal, float("-inf"))  # intentional: never the culprit
        s = s.masked_fill(pad[:, None, :], float("-inf"))
        return torch.softmax(s, dim=-1) @ self.v(x)  # CULPRIT: masked_row


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"attn": Attention()})])
        self.out = nn.Linear(8, 1)

    def forward(self, x, pad):
        for layer in self.layers:
            x = x + layer["attn"](x, pad)
        return self.out(x).mean()


def _attn_batch(pad_first: bool):
    def make():
        torch.manual_seed(6)
        x = torch.randn(2, 5, 8)
        pad = torch.zeros(2, 5, dtype=torch.bool)
        pad[1, 3:] = True  # ordinary right padding: every row keeps an allowed position
        if pad_first:
            pad[0, 0] = True  # the first query may only look at position 0, which is padding
        return {"x": (x, pad)}
    return make


@case("masked_row", _attn_batch(True), phase="forward", kind="nan", op="aten._softmax.default",
      forward_op="aten._softmax.default", module="layers.0.attn", role="conversion")
@seeded
def encoder():
    return Encoder()


case("healthy_mask", _attn_batch(False), verdict="not_reproduced")(encoder)  # the same model, ordinary padding


# ---------------------------------------------------------------- the torch.where trap


class SafeLog(nn.Module):
    """A 'safe' log: where() hides log(0) = -inf in forward, but not its gradient."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = x * self.w
        return torch.where(h > 0, torch.log(h), torch.zeros_like(h)).sum()  # CULPRIT: where_trap


def _sparse_batch():
    torch.manual_seed(8)
    x = torch.rand(5, 4)
    x[x < 0.3] = 0.0  # sparse features: exact zeros
    return {"x": x}


@case("where_trap", _sparse_batch, phase="backward", kind="nan", op="aten.div.Tensor",
      forward_op="aten.log.default", backward_node="LogBackward0", module="", failure="gradient",
      anomaly=True, agrees=True)
@seeded
def safe_log():
    return SafeLog()


# ---------------------------------------------------------------- a culprit inside the loss function


class Probs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return F.relu(self.fc(x))


def log_loss(p, y):
    return -(torch.log(p) * y).sum(-1).mean()  # CULPRIT: in_loss


def _prob_batch():
    b = _relu_zero_batch()
    b["y"] = torch.ones(8, 3)
    return b


@case("in_loss", _prob_batch, loss="nanmodels:log_loss", phase="forward", kind="inf", op="aten.log.default",
      forward_op="aten.log.default", module="<loss>")
@seeded
def probs():
    return Probs()


# ---------------------------------------------------------------- Inf that becomes NaN downstream (backward)


class ExpGate(nn.Module):
    """exp overflows to Inf in forward; the loss multiplies by a 0 mask -> Inf*0 = NaN."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.mul_(400)

    def forward(self, x):
        return torch.exp(self.fc(x))  # CULPRIT: inf_to_nan


def _gate_batch():
    torch.manual_seed(7)
    return {"x": torch.randn(3, 4), "y": torch.zeros(3, 4)}


def gated_loss(out, mask):
    return (out * mask).sum()


@case("inf_to_nan", _gate_batch, loss="nanmodels:gated_loss", phase="forward", kind="inf",
      op="aten.exp.default", forward_op="aten.exp.default", module="", anomaly=True, agrees=True)
@seeded
def exp_gate():
    return ExpGate()


# ---------------------------------------------------------------- a healthy model


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


@seeded
def tiny():
    return Tiny()


def half_mlp_fp32():
    """The fp16 case's model as a factory would usually build it: in float32."""
    torch.manual_seed(0)
    return HalfMLP()


# ---------------------------------------------------------------- one model, three causes (for triage)


class ThreeCauses(nn.Module):
    """`branch` (a 0-d tensor in the batch) picks which of three classic bugs the step runs into,
    so a folder of snapshots of one model can hold several root causes (one --model for all)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.embed = nn.Linear(4, 4, bias=False)

    def forward(self, x, branch):
        k = int(branch)
        if k == 0:
            return -torch.log(F.relu(self.fc(x))).mean()  # CULPRIT: triage_log_zero
        h = self.embed(x)
        if k == 1:
            return (h / h.norm(dim=-1, keepdim=True)).sum()  # CULPRIT: triage_zero_norm
        return (h ** 2).sum(-1).sqrt().mean()  # CULPRIT: triage_sqrt_zero


@seeded
def three_causes():
    return ThreeCauses()


def save_three_causes(branch: int, path: Path, seed: int = 0) -> Path:
    """A plain state-dict snapshot of ThreeCauses that fails in `branch` (0 log(0), 1 0/0, 2 sqrt(0))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=g)
    if branch:
        x[seed % 8] = 0  # an all-zero row: zero norm, zero distance
    torch.save({"x": (x, torch.tensor(branch)), "state": three_causes().state_dict()}, path)
    return path


# ---------------------------------------------------------------- a bug in a custom autograd.Function's backward


class SafeInv(torch.autograd.Function):
    """1/x with a clamp in forward — and none in the hand-written backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp_min(1e-3).reciprocal()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return -g / (x * x)  # CULPRIT: custom_backward


class InvFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return SafeInv.apply(x * self.w).mean()


@case("custom_backward", _sparse_batch, phase="backward", kind="inf", op="aten.div.Tensor",
      forward_op="aten.clamp_min.default", backward_node="SafeInvBackward", module="", failure="gradient")
@seeded
def inv_features():
    return InvFeatures()
