"""Purpose-built models for the diagnosis catalogue: one small model per cause.

Same style as `nanmodels.py` (see `cases.py`): each case is a zero-argument model factory
(what `--model causes:<factory>` names), a batch and an optional loss spec. The line that
should be blamed carries a `# CULPRIT: <case>` marker. `expect` holds the diagnosis the
case must get: its `cause` and `fix` kind, plus culprit keys (`phase`, `kind`, `op`,
`forward_op`, `backward_node`, `module`) and `verdict`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases import Registry, seeded

CASES = Registry(__name__)
case = CASES.case


def _randn(seed: int, *shape: int) -> Callable[[], dict]:
    def make():
        torch.manual_seed(seed)
        return {"x": torch.randn(*shape)}
    return make


# ---------------------------------------------------------------- sqrt(E[x²] − E[x]²): cancellation


class OnePassScaler(nn.Module):
    """Standardises features with a one-pass variance; a constant feature cancels to a tiny negative."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        mu = x.mean(0)
        var = (x * x).mean(0) - mu * mu
        std = torch.sqrt(var)  # CULPRIT: sqrt_cancellation
        return self.head((x - mu) / (std + 1e-3)).mean()


def _constant_feature():
    torch.manual_seed(10)
    x = torch.randn(7, 4)
    x[:, 2] = 1.3  # a constant feature: its variance is 0, computed as 1.69 - 1.69 it rounds below 0
    return {"x": x}


@case("sqrt_cancellation", _constant_feature, cause="sqrt_cancellation", fix="stable_variance", phase="forward",
      kind="nan", op="aten.sqrt.default")
@seeded
def one_pass_scaler():
    return OnePassScaler()


# ---------------------------------------------------------------- log(sigmoid(x)) -> logsigmoid


class PositiveLikelihood(nn.Module):
    """-log p(positive) for a confident scorer: sigmoid(-200) is exactly 0 in float32."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.mul_(150)

    def forward(self, x):
        return -torch.log(torch.sigmoid(self.fc(x))).mean()  # CULPRIT: log_sigmoid


@case("log_sigmoid", _randn(11, 8, 4), cause="logsigmoid", fix="logsigmoid", phase="forward", kind="inf",
      op="aten.log.default")
@seeded
def positive_likelihood():
    return PositiveLikelihood()


class GuardedLogSigmoid(nn.Module):
    """where() guards the forward of log(sigmoid(z)), not its gradient: the where trap, not a logsigmoid case."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.mul_(150)

    def forward(self, x):
        p = torch.sigmoid(self.fc(x))
        return torch.where(p > 0, torch.log(p), torch.zeros_like(p)).mean()  # CULPRIT: where_over_sigmoid


@case("where_over_sigmoid", _randn(11, 8, 4), cause="where_trap", fix="double_where", phase="backward",
      kind="nan", forward_op="aten.log.default", backward_node="LogBackward0")
@seeded
def guarded_log_sigmoid():
    return GuardedLogSigmoid()


# ---------------------------------------------------------------- hand-written BCE on a saturated sigmoid


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.mul_(30)
            self.fc.bias.fill_(40.0)  # confident positives: sigmoid rounds to exactly 1

    def forward(self, x):
        return torch.sigmoid(self.fc(x)).squeeze(-1)


def handwritten_bce(p, y):
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # CULPRIT: bce_saturated


def _bce_batch():
    torch.manual_seed(12)
    return {"x": torch.randn(8, 4), "y": (torch.rand(8) > 0.5).float()}


@case("bce_saturated", _bce_batch, loss="causes:handwritten_bce", cause="bce_saturated", fix="bce_with_logits",
      phase="forward", kind="inf", op="aten.log.default", module="<loss>")
@seeded
def scorer():
    return Scorer()


# ---------------------------------------------------------------- x / 0 and 1 / 0


class Speed(nn.Module):
    """distance / predicted duration, clamped into [0, 1]: exactly 0 for some rows. (Not a ReLU: a ReLU-made
    divisor gets softplus where it is made, diagnose/edits/posfix.py; this case is the ε's.)"""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        t = self.fc(x).clamp(0, 1)
        return (x[:, :1].abs() / t).mean()  # CULPRIT: x_over_zero


@case("x_over_zero", _randn(13, 8, 4), cause="division_by_zero", fix="epsilon", phase="forward", kind="inf",
      op="aten.div.Tensor")
@seeded
def speed():
    return Speed()


class SignedScale(nn.Module):
    """x / s with a learned, signed per-feature divisor in float16; a pruned feature has s = 0 exactly."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor([0.5, -0.25, 0.0, 1.0]))

    def forward(self, x):
        return (x / self.s).mean()  # CULPRIT: signed_zero_fp16


def _half_batch():
    torch.manual_seed(13)
    return {"x": torch.randn(8, 4).half()}


@case("signed_zero_fp16", _half_batch, cause="division_by_zero", fix="epsilon", phase="forward", kind="inf",
      op="aten.div.Tensor")
def signed_scale_half():
    """float16: an eps that only looks at the values (1e-4) would overflow the gradient x / eps²."""
    return SignedScale().half()


class InverseRate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        rate = self.fc(x).clamp(0, 1)  # not a ReLU (that gets softplus where it is made): the ε's case
        return (1.0 / rate).mean()  # CULPRIT: reciprocal_zero


@case("reciprocal_zero", _randn(13, 8, 4), cause="division_by_zero", fix="epsilon", phase="forward", kind="inf",
      op="aten.reciprocal.default")
@seeded
def inverse_rate():
    return InverseRate()


# ---------------------------------------------------------------- (x - mean) / std: constant feature, batch of one


class BatchStandardize(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        z = (x - x.mean(0)) / x.std(0)  # CULPRIT: std_constant
        return self.head(z).mean()


def _constant_column():
    torch.manual_seed(14)
    x = torch.randn(6, 3)
    x[:, 1] = 0.5  # a constant feature: std = 0 and x - mean = 0
    return {"x": x}


@case("std_constant", _constant_column, cause="normalize_zero_norm", fix="epsilon", phase="forward", kind="nan",
      op="aten.div.Tensor")
@seeded
def batch_standardize():
    return BatchStandardize()


class LearnedStandardize(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return ((h - h.mean(0)) / h.std(0)).pow(2).mean()  # CULPRIT: std_single


@case("std_single", _randn(15, 1, 4), cause="std_single_element", fix="correction", phase="forward", kind="nan",
      op="aten.std.correction")
@seeded
def learned_standardize():
    return LearnedStandardize()


# ---------------------------------------------------------------- hand-written softmax and logsumexp overflow


class HandSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        with torch.no_grad():
            self.fc.weight.mul_(400)

    def forward(self, x):
        e = self.fc(x).exp()  # CULPRIT: handwritten_softmax
        p = e / e.sum(-1, keepdim=True)
        return -(p[:, 0] + 1e-6).log().mean()


@case("handwritten_softmax", _randn(16, 5, 4), cause="handwritten_softmax", fix="max_subtraction",
      phase="forward", kind="inf", op="aten.exp.default")
@seeded
def hand_softmax():
    return HandSoftmax()


class HandLogSumExp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        with torch.no_grad():
            self.fc.weight.mul_(400)

    def forward(self, x):
        s = self.fc(x)
        return (torch.log(torch.exp(s).sum(dim=1)) - s[:, 0]).mean()  # CULPRIT: handwritten_logsumexp


@case("handwritten_logsumexp", _randn(16, 5, 4), cause="handwritten_softmax", fix="max_subtraction",
      phase="forward", kind="inf", op="aten.exp.default")
@seeded
def hand_logsumexp():
    return HandLogSumExp()


# ---------------------------------------------------------------- acos / asin at the edge of [-1, 1]


class Angle(nn.Module):
    """The angle between two embeddings; identical inputs round the cosine just above 1."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 8)

    def forward(self, a, b):
        ea, eb = self.enc(a), self.enc(b)
        cos = (ea * eb).sum(-1) / (ea.norm(dim=-1) * eb.norm(dim=-1))
        return torch.acos(cos).mean()  # CULPRIT: acos_outside


def _same_pairs():
    torch.manual_seed(17)
    a = torch.randn(16, 6)
    b = a.clone()
    b[:4] += torch.randn(4, 6)
    return {"x": (a, b)}


@case("acos_outside", _same_pairs, cause="acos_asin_boundary", fix="clamp", phase="forward", kind="nan",
      op="aten.acos.default")
@seeded
def angle():
    return Angle()


class BoundedAngle(nn.Module):
    """asin(tanh(z)): a bounded angle; tanh saturates to exactly 1, where asin' = 1/sqrt(1 - x²) = Inf."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.fc.weight.mul_(20)

    def forward(self, x):
        return torch.asin(torch.tanh(self.fc(x))).sum()  # CULPRIT: asin_at_one


@case("asin_at_one", _randn(18, 6, 4), cause="acos_asin_boundary", fix="clamp", phase="backward", kind="inf",
      forward_op="aten.asin.default", backward_node="AsinBackward0")
@seeded
def bounded_angle():
    return BoundedAngle()


# ---------------------------------------------------------------- fractional powers


class PowerScale(nn.Module):
    """(x * s) ** 0.5 on sparse features: d/ds = 0.5 x (x s) ** -0.5 = 0 * Inf at x = 0."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head((x * self.scale) ** 0.5).mean()  # CULPRIT: pow_at_zero


def _sparse():
    torch.manual_seed(19)
    x = torch.rand(6, 4)
    x[x < 0.3] = 0.0
    return {"x": x}


@case("pow_at_zero", _sparse, cause="pow_at_zero", fix="epsilon", phase="backward", kind="inf",
      forward_op="aten.pow.Tensor_Scalar", backward_node="PowBackward0")
@seeded
def power_scale():
    return PowerScale()


class PowerLaw(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.pow(self.fc(x), 1.5).mean()  # CULPRIT: pow_negative


@case("pow_negative", _randn(20, 6, 4), cause="pow_of_negative", fix="clamp", phase="forward", kind="nan",
      op="aten.pow.Tensor_Scalar")
@seeded
def power_law():
    return PowerLaw()


# ---------------------------------------------------------------- float32 overflow from exploded weights


class Diverged(nn.Module):
    """Earlier steps blew the weights up to ~1e19 (finite); this step's matmul overflows float32."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 1)
        with torch.no_grad():
            self.fc1.weight.fill_(3e19)
            self.fc2.weight.fill_(3e19)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).mean()  # CULPRIT: exploded


def _positive():
    torch.manual_seed(21)
    return {"x": torch.rand(4, 8) + 0.5}


@case("exploded", _positive, cause="exploded_weights", fix="lower_lr_clip_grads", phase="forward", kind="inf",
      op="aten.addmm.default", module="fc2")
@seeded
def diverged():
    return Diverged()


# ---------------------------------------------------------------- reductions over nothing


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(x)


def _all_ignored():
    torch.manual_seed(22)
    return {"x": torch.randn(6, 4), "y": torch.full((6,), -100)}  # a padding-only batch


@case("ce_all_ignored", _all_ignored, loss="cross_entropy", cause="empty_reduction", fix="guard_empty_reduction",
      phase="forward", kind="nan", op="aten.nll_loss_forward.default", module="<loss>")
@seeded
def tagger():
    return Tagger()


def padded_ce(logits, y):
    return F.cross_entropy(logits, y, ignore_index=0)  # CULPRIT: ce_pad_ignored


def _all_pad():
    torch.manual_seed(22)
    return {"x": torch.randn(6, 4), "y": torch.zeros(6, dtype=torch.long)}  # pad id 0 everywhere


@case("ce_pad_ignored", _all_pad, loss="causes:padded_ce", cause="empty_reduction", fix="guard_empty_reduction",
      phase="forward", kind="nan", op="aten.nll_loss_forward.default", module="<loss>")
@seeded
def pad_tagger():
    return Tagger()


class Distance(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x).pow(2).sum(-1)


def positive_pair_loss(d, y):
    return d[y == 1].mean()  # CULPRIT: empty_mean


def _no_positives():
    torch.manual_seed(23)
    return {"x": torch.randn(6, 4), "y": torch.zeros(6, dtype=torch.long)}  # no positive pair in this batch


@case("empty_mean", _no_positives, loss="causes:positive_pair_loss", cause="empty_reduction",
      fix="guard_empty_reduction", phase="forward", kind="nan", op="aten.mean.default", module="<loss>")
@seeded
def distance():
    return Distance()


# ---------------------------------------------------------------- float16 under CPU autocast


class AutocastMLP(nn.Module):
    """float32 weights run under torch.autocast('cpu', dtype=torch.float16): fc1's output passes 65504."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 1)
        with torch.no_grad():
            self.fc1.weight.fill_(40.0)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).float().mean()  # CULPRIT: autocast_fp16


def _big_inputs():
    return {"x": torch.full((4, 16), 120.0)}


AUTOCAST = {"device_type": "cpu", "dtype": torch.float16}


@case("autocast_fp16", _big_inputs, cause="fp16_overflow", fix="bf16_or_grad_scaler", phase="forward",
      kind="inf", op="aten.addmm.default", module="fc1", autocast=AUTOCAST)
@seeded
def autocast_mlp():
    return AutocastMLP()


# ---------------------------------------------------------------- near overflow: finite, but close to 65504


class LoudHalf(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 1)
        with torch.no_grad():
            self.fc1.weight.fill_(40.0)
            self.fc1.bias.zero_()

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).float().mean()


def _medium_half():
    return {"x": torch.full((4, 16), 15.0).half()}  # fc1 reaches 16 * 40 * 15 = 9600: 15% of float16's max


@case("near_overflow", _medium_half, verdict="not_reproduced")
def loud_half():
    torch.manual_seed(0)
    return LoudHalf().half()


# ---------------------------------------------------------------- a pattern no rule knows


class Probit(nn.Module):
    """A probit link: erfinv(2p - 1) is +Inf where the sigmoid saturated to p = 1: the domain table's erfinv at ±1.
    Clamping keeps it finite, but the loss is then whatever the clamp says (erfinv(1 - ε) grows as ε shrinks)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.fc.weight.mul_(40)

    def forward(self, x):
        p = torch.sigmoid(self.fc(x))
        return torch.erfinv(2 * p - 1).mean()  # CULPRIT: unknown_erfinv


@case("unknown_erfinv", _randn(24, 8, 4), cause="domain_edge", fix="clamp", phase="forward", kind="inf",
      op="aten.erfinv.default")
@seeded
def probit():
    return Probit()


class Bessel(nn.Module):
    """i0(z) of large z overflows float32 (i0(100) ≈ 1e42): no rule knows i0, so nothing is invented."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.fc.weight.mul_(300)

    def forward(self, x):
        return torch.special.i0(self.fc(x)).mean()  # CULPRIT: unknown_i0


@case("unknown_i0", _randn(24, 8, 4), cause="unrecognised", fix="none", phase="forward", kind="inf",
      op="aten.i0.default")
@seeded
def bessel():
    return Bessel()


# ---------------------------------------------------------------- the call that ran, not the smallest match


class RMSHead(nn.Module):
    """sqrt of a mean square written as `** 0.5` after a `.pow(2)`: the culprit is the `** 0.5` (its
    gradient at 0), not `h.pow(2)`, though both are Tensor.pow calls on the line."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3, bias=False)

    def forward(self, x):
        h = self.fc(x)
        return (h.pow(2).mean(-1) ** 0.5).mean()  # CULPRIT: pow_after_pow


def _zero_sample():
    torch.manual_seed(25)
    x = torch.randn(5, 4)
    x[2] = 0.0  # an empty sample: its features, and their mean square, are exactly 0
    return {"x": x}


@case("pow_after_pow", _zero_sample, cause="pow_at_zero", fix="epsilon", phase="backward", kind="inf",
      forward_op="aten.pow.Tensor_Scalar", backward_node="PowBackward0")
@seeded
def rms_head():
    return RMSHead()


class NormBlock(nn.Module):
    """A residual block that divides by the norm of its input: the same line runs in every block."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return x + self.fc(x) / x.norm(dim=-1, keepdim=True)  # CULPRIT: every_block


class NormStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([NormBlock() for _ in range(3)])
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean()


@case("every_block", _zero_sample, cause="normalize_zero_norm", fix="epsilon", phase="forward", kind="nan",
      op="aten.div.Tensor", module="blocks.0")
@seeded
def norm_stack():
    return NormStack()


# ---------------------------------------------------------------- a fix in the user's names, or guidance


class PaddedAttention(nn.Module):
    """nn.MultiheadAttention with a key padding mask; one sequence is all padding: every key masked."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x, pad):
        h, _ = self.mha(x, x, x, key_padding_mask=pad)  # CULPRIT: mha_all_padding
        return self.out(h).mean()


def _all_padding():
    torch.manual_seed(26)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1] = True  # the second sequence is padding only
    return {"x": (torch.randn(3, 5, 8), pad)}


@case("mha_all_padding", _all_padding, cause="softmax_all_masked", fix="finite_mask_value", module="mha")
@seeded
def padded_attention():
    return PaddedAttention()


# ---------------------------------------------------------------- weights already exploded: NaN inside a normalisation


class ExplodedNorm(nn.Module):
    """Weights of 3e19 (an earlier step diverged): the LayerNorm's variance overflows, inf - inf = NaN."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.fc.weight.normal_(0, 3e19)

    def forward(self, x):
        return self.head(self.norm(self.fc(x))).mean()  # CULPRIT: exploded_norm


@case("exploded_norm", _positive, cause="exploded_weights", fix="lower_lr_clip_grads", phase="forward", kind="nan",
      op="aten.native_layer_norm.default", module="norm")
@seeded
def exploded_norm():
    return ExplodedNorm()


class ExplodedBF16(nn.Module):
    """A bfloat16 model whose weights exploded: bfloat16 has float32's range, so bfloat16 is no fix."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 1)
        with torch.no_grad():
            self.fc1.weight.fill_(3e19)
            self.fc2.weight.fill_(3e19)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).float().mean()  # CULPRIT: bf16_overflow


def _positive_bf16():
    return {"x": _positive()["x"].bfloat16()}


@case("bf16_overflow", _positive_bf16, cause="exploded_weights", fix="lower_lr_clip_grads", phase="forward",
      kind="inf", module="fc2")
def exploded_bf16():
    torch.manual_seed(0)
    return ExplodedBF16().bfloat16()


# ---------------------------------------------------------------- magnitude provenance: exp made it huge, mse overflowed


class PixelVAE(nn.Module):
    """A VAE fed raw pixels (0..255): logvar reaches ~140, exp(0.5 * logvar) a finite 1e30, and the
    reconstruction loss squares it past float32's range."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.dec = nn.Linear(4, 16)

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        std = torch.exp(0.5 * logvar)  # MAGNITUDE: vae_exp
        z = mu + std * torch.randn_like(std)
        return self.dec(z)


def _pixels():
    torch.manual_seed(27)
    x = torch.rand(6, 16) * 255  # not normalised to [0, 1]
    return {"x": x, "y": x}


@case("vae_pixels", _pixels, loss="mse_loss", cause="huge_values", fix="none", phase="forward", kind="inf",
      op="aten.mse_loss.default", module="<loss>", marker="none")
@seeded
def pixel_vae():
    return PixelVAE()


# ---------------------------------------------------------------- a second look: masked mean, variance cancellation


class TokenRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, mask):
        per_token = (self.fc(x).squeeze(-1) - 1.0) ** 2
        main = per_token.mean()
        masked = (per_token * mask).sum() / mask.sum()  # CULPRIT: masked_mean
        return main + 0.1 * masked


def _no_tokens():
    torch.manual_seed(28)
    return {"x": (torch.randn(2, 6, 4), torch.zeros(2, 6))}  # the mask selects no token in this batch


@case("masked_mean", _no_tokens, cause="masked_mean_empty", fix="guard_empty_reduction", phase="forward", kind="nan",
      op="aten.div.Tensor")
@seeded
def token_regressor():
    return TokenRegressor()


class HandLayerNorm(nn.Module):
    """A hand-written layer norm, variance as E[h²] − E[h]²: near-constant rows with a large offset cancel
    to a negative variance larger than the eps added to it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.head = nn.Linear(6, 1)
        with torch.no_grad():
            self.fc.weight.mul_(1e-4)
            self.fc.bias.fill_(1000.0)

    def forward(self, x):
        h = self.fc(x)
        mu = h.mean(-1, keepdim=True)
        var = (h * h).mean(-1, keepdim=True) - mu * mu
        return self.head((h - mu) / torch.sqrt(var + 1e-5)).mean()  # CULPRIT: var_cancellation


@case("var_cancellation", _randn(29, 8, 4), cause="sqrt_cancellation", fix="stable_variance", phase="forward",
      kind="nan", op="aten.sqrt.default")
@seeded
def hand_layer_norm():
    return HandLayerNorm()


# ---------------------------------------------------------------- a tiny GPT trained with a learning rate far too high


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))  # CULPRIT: diverged_gpt


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, ctx: int = 16, d: int = 32, heads: int = 2, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


@seeded
def tiny_gpt():
    return TinyGPT()


def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 32, (8, 17), generator=g)
    return x[:, :-1], x[:, 1:]


# ---------------------------------------------------------------- state that every replay touches (for the copies test)


class NormedRate(nn.Module):
    """BatchNorm in train mode (its running stats change on every forward), dropout (it draws random
    numbers), an in-place op on the batch, and a log of a ReLU rate that hits 0."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        x.mul_(1.0)  # writes into the batch
        p = F.relu(self.drop(self.fc(self.bn(x))))
        return -torch.log(p).mean()  # CULPRIT: stateful_log_zero


@case("stateful_log_zero", _randn(30, 8, 4), cause="log_of_zero", fix="positive_parametrisation", phase="forward", kind="inf",
      op="aten.log.default")
@seeded
def normed_rate():
    return NormedRate()


# ---------------------------------------------------------------- root, not site: a denominator two quotients share


class TwoNormalised(nn.Module):
    """Two terms divided by the same norm, computed once: a sample that is all zeros makes it 0 for both."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = F.relu(self.fc(x)) * (x.abs().sum(-1, keepdim=True) > 0)  # an all-zero sample stays all zero
        norm = h.norm(dim=-1, keepdim=True)
        a = h / norm  # CULPRIT: shared_zero_norm
        b = h.pow(2) / norm
        return (a + b).sum()


def _zero_sample():
    torch.manual_seed(21)
    x = torch.randn(6, 4)
    x[2] = 0.0
    return {"x": x}


@case("shared_zero_norm", _zero_sample, cause="normalize_zero_norm", fix="epsilon", phase="forward", kind="nan",
      op="aten.div.Tensor")
@seeded
def two_normalised():
    return TwoNormalised()


# ---------------------------------------------------------------- a small regressor for runs that replay finite


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)


@seeded
def regressor():
    return Regressor()


def regression_batch(step: int, outlier: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)
    if outlier:
        x[3] *= 1000.0  # one corrupt sample in the batch
        y[3] = 50.0
    return x, y
