"""The zoo's architectures: the world's model code built tiny, each with a training batch and its loss.

* Every model type of the installed `transformers`, taken from its own auto-model mappings (causal LM,
  masked LM, seq2seq, sequence / image / audio classification, CTC), built from its config class with the
  common size attributes shrunk (no weights are downloaded: random init, synthetic batches).
* Every `torch.nn` layer family and loss with default arguments, each in a small stack.
* A ResNet-style CNN with BatchNorm, an LSTM and a GRU language model.
* diffusers' UNet2DModel and AutoencoderKL, where diffusers is installed.

    for arch in all_archs():            # Arch(name, family, make)
        built = arch.make()             # Built(model, batch(step) -> (inputs, target), loss_fn, ...)

An architecture that cannot be built or trained is kept with the reason (`Skipped`), never hidden.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from arch_types import Arch, Built, Skipped
from hf_archs import hf_archs
from lib_archs import lib_archs

__all__ = ["Arch", "Built", "Skipped", "all_archs", "hf_archs", "select"]

# ---------------------------------------------------------------- torch.nn layer stacks

def _seq(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers)


class _Take(nn.Module):
    """The first output of a layer that returns a tuple (RNNs, attention)."""

    def __init__(self, layer: nn.Module, self_attention: bool = False):
        super().__init__()
        self.layer, self.self_attention = layer, self_attention

    def forward(self, x):
        out = self.layer(x, x, x) if self.self_attention else self.layer(x)
        return out[0] if isinstance(out, tuple) else out


class _Pair(nn.Module):
    """A layer that takes two inputs (bilinear, transformer decoder, nn.Transformer): (x, x)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x, x)


class _EmbedBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 16)

    def forward(self, idx):
        return self.bag(idx)


def regression_loss(out, target=None):
    """Mean squared error against a fixed target of the output's shape (the layer stacks' loss)."""
    return F.mse_loss(out, torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))


def _regression(model, in_shape, *, ints=None, family="torch.nn") -> Callable[[], Built]:
    def make() -> Built:
        torch.manual_seed(0)
        m = model()
        m.train()

        def batch(step):
            g = torch.Generator().manual_seed(step)
            if ints is not None:
                return torch.randint(0, ints, in_shape, generator=g), None
            return torch.randn(*in_shape, generator=g), None
        return Built(m, batch, regression_loss)
    return make


def nn_layer_archs() -> list[Arch]:
    d = 16
    L = nn.Linear
    x3 = (2, 6, d)  # (batch, sequence, features)
    img = (2, 4, 8, 8)
    vol = (2, 4, 4, 4, 4)
    seq1 = (2, 4, 16)
    stacks: dict[str, tuple[Callable[[], nn.Module], tuple, int | None]] = {
        "RNN": (lambda: _seq(L(d, d), _Take(nn.RNN(d, d, batch_first=True))), x3, None),
        "LSTM": (lambda: _seq(L(d, d), _Take(nn.LSTM(d, d, num_layers=2, batch_first=True))), x3, None),
        "GRU": (lambda: _seq(L(d, d), _Take(nn.GRU(d, d, batch_first=True, bidirectional=True))), x3, None),
        "RNNCell": (lambda: _seq(L(d, d), nn.RNNCell(d, d)), (2, d), None),
        "LSTMCell": (lambda: _seq(L(d, d), _Take(nn.LSTMCell(d, d))), (2, d), None),
        "GRUCell": (lambda: _seq(L(d, d), nn.GRUCell(d, d)), (2, d), None),
        "TransformerEncoderLayer": (lambda: nn.TransformerEncoderLayer(d, 2, 32, batch_first=True), x3, None),
        "TransformerDecoderLayer": (lambda: _Pair(nn.TransformerDecoderLayer(d, 2, 32, batch_first=True)), x3, None),
        "Transformer": (lambda: _Pair(nn.Transformer(d, 2, 1, 1, 32, batch_first=True)), x3, None),
        "MultiheadAttention": (lambda: _Take(nn.MultiheadAttention(d, 2, batch_first=True), True), x3, None),
        "Bilinear": (lambda: _Pair(nn.Bilinear(d, d, d)), (2, d), None),
        "Conv1d": (lambda: _seq(nn.Conv1d(4, 4, 3, padding=1), nn.Conv1d(4, 4, 3, stride=2)), seq1, None),
        "Conv2d": (lambda: _seq(nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, groups=2)), img, None),
        "Conv3d": (lambda: nn.Conv3d(4, 4, 3, padding=1), vol, None),
        "ConvTranspose1d": (lambda: nn.ConvTranspose1d(4, 4, 3, stride=2), seq1, None),
        "ConvTranspose2d": (lambda: nn.ConvTranspose2d(4, 4, 3, stride=2), img, None),
        "ConvTranspose3d": (lambda: nn.ConvTranspose3d(4, 4, 3), vol, None),
        "BatchNorm1d": (lambda: _seq(L(d, d), nn.BatchNorm1d(d)), (4, d), None),
        "BatchNorm2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)), img, None),
        "BatchNorm3d": (lambda: _seq(nn.Conv3d(4, 4, 3), nn.BatchNorm3d(4)), vol, None),
        "InstanceNorm1d": (lambda: _seq(nn.Conv1d(4, 4, 3), nn.InstanceNorm1d(4, affine=True)), seq1, None),
        "InstanceNorm2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.InstanceNorm2d(4, affine=True)), img, None),
        "InstanceNorm3d": (lambda: _seq(nn.Conv3d(4, 4, 3), nn.InstanceNorm3d(4, affine=True)), vol, None),
        "GroupNorm": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.GroupNorm(2, 4)), img, None),
        "LayerNorm": (lambda: _seq(L(d, d), nn.LayerNorm(d)), x3, None),
        "RMSNorm": (lambda: _seq(L(d, d), nn.RMSNorm(d)), x3, None),
        "LocalResponseNorm": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.LocalResponseNorm(2)), img, None),
        "CrossMapLRN2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.CrossMapLRN2d(2)), img, None),
        "Embedding": (lambda: _seq(nn.Embedding(50, d), L(d, d)), (2, 6), 50),
        "EmbeddingBag": (lambda: _seq(_EmbedBag(), L(d, d)), (2, 6), 50),
        "MaxPool2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.MaxPool2d(2)), img, None),
        "AvgPool2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.AvgPool2d(2)), img, None),
        "MaxPool1d": (lambda: _seq(nn.Conv1d(4, 4, 3), nn.MaxPool1d(2)), seq1, None),
        "AvgPool1d": (lambda: _seq(nn.Conv1d(4, 4, 3), nn.AvgPool1d(2)), seq1, None),
        "MaxPool3d": (lambda: _seq(nn.Conv3d(4, 4, 1), nn.MaxPool3d(2)), vol, None),
        "AvgPool3d": (lambda: _seq(nn.Conv3d(4, 4, 1), nn.AvgPool3d(2)), vol, None),
        "LPPool2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.LPPool2d(2, 2)), img, None),
        "FractionalMaxPool2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.FractionalMaxPool2d(2, output_size=3)), img, None),
        "AdaptiveAvgPool2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.AdaptiveAvgPool2d(3)), img, None),
        "AdaptiveMaxPool2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.AdaptiveMaxPool2d(3)), img, None),
        "AdaptiveAvgPool1d": (lambda: _seq(nn.Conv1d(4, 4, 3), nn.AdaptiveAvgPool1d(5)), seq1, None),
        "Upsample": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.Upsample(scale_factor=2, mode="bilinear")), img, None),
        "UpsamplingNearest2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.UpsamplingNearest2d(scale_factor=2)), img, None),
        "PixelShuffle": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.PixelShuffle(2)), img, None),
        "ReflectionPad2d": (lambda: _seq(nn.ReflectionPad2d(1), nn.Conv2d(4, 4, 3)), img, None),
        "ReplicationPad2d": (lambda: _seq(nn.ReplicationPad2d(1), nn.Conv2d(4, 4, 3)), img, None),
        "CircularPad2d": (lambda: _seq(nn.CircularPad2d(1), nn.Conv2d(4, 4, 3)), img, None),
        "ZeroPad2d": (lambda: _seq(nn.ZeroPad2d(1), nn.Conv2d(4, 4, 3)), img, None),
        "Dropout": (lambda: _seq(L(d, d), nn.Dropout(0.2), L(d, d)), x3, None),
        "Dropout2d": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.Dropout2d(0.2)), img, None),
        "AlphaDropout": (lambda: _seq(L(d, d), nn.AlphaDropout(0.2)), x3, None),
        "Unfold": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.Unfold(2)), img, None),
        "Flatten": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.Flatten(), L(144, 8)), img, None),
        "CosineSimilarity": (lambda: _seq(L(d, d), _Pair(nn.CosineSimilarity())), x3, None),
        "PairwiseDistance": (lambda: _seq(L(d, d), _Pair(nn.PairwiseDistance())), (4, d), None),
        "ChannelShuffle": (lambda: _seq(nn.Conv2d(4, 4, 3), nn.ChannelShuffle(2)), img, None),
        "weight_norm": (lambda: _seq(nn.utils.parametrizations.weight_norm(L(d, d)), nn.ReLU(),
                                     nn.utils.parametrizations.weight_norm(nn.Conv1d(6, 6, 3, padding=1))), x3, None),
        "weight_norm(old)": (lambda: _seq(nn.utils.weight_norm(L(d, d)), nn.Tanh()), x3, None),
        "spectral_norm": (lambda: _seq(nn.utils.parametrizations.spectral_norm(L(d, d)), nn.ReLU(), L(d, d)), x3, None),
        "orthogonal": (lambda: _seq(nn.utils.parametrizations.orthogonal(L(d, d)), nn.ReLU()), x3, None),
    }
    out = [Arch(f"nn:{name}", "torch.nn", _regression(f, shape, ints=ints), "layer")
           for name, (f, shape, ints) in stacks.items()]
    for name in _activation_names():
        cls = getattr(nn, name)
        out.append(Arch(f"nn:{name}", "torch.nn", _regression(_activation_stack(cls), x3), "activation"))
    out.extend(_loss_archs())
    return out


def _activation_names() -> list[str]:
    import torch.nn.modules.activation as act

    skip = {"MultiheadAttention", "Threshold", "Softmax2d"}  # need arguments / 4D input: covered elsewhere
    return [n for n in act.__all__ if n not in skip]


def _activation_stack(cls) -> Callable[[], nn.Module]:
    d = 16

    def build():
        kw = {"dim": -1} if cls in (nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.GLU) else {}
        layer = cls(**kw)
        width = d // 2 if cls is nn.GLU else d
        return _seq(nn.Linear(d, d), layer, nn.Linear(width, d))
    return build


def _loss_archs() -> list[Arch]:
    """Every torch.nn loss with default arguments, after a small linear model."""
    d, n, k = 16, 6, 5
    gen = torch.Generator().manual_seed(7)

    def cls_target(g):
        return torch.randint(0, k, (n,), generator=g)

    losses: dict[str, tuple[Callable[[], nn.Module], Callable, Callable]] = {
        # name: (loss module, output transform, target maker)
        "L1Loss": (nn.L1Loss, lambda o: o, lambda g: torch.randn(n, k, generator=g)),
        "MSELoss": (nn.MSELoss, lambda o: o, lambda g: torch.randn(n, k, generator=g)),
        "CrossEntropyLoss": (nn.CrossEntropyLoss, lambda o: o, cls_target),
        "CrossEntropyLoss(label_smoothing)": (lambda: nn.CrossEntropyLoss(label_smoothing=0.1), lambda o: o, cls_target),
        "NLLLoss": (nn.NLLLoss, lambda o: F.log_softmax(o, -1), cls_target),
        "BCELoss": (nn.BCELoss, torch.sigmoid, lambda g: torch.rand(n, k, generator=g)),
        "BCEWithLogitsLoss": (nn.BCEWithLogitsLoss, lambda o: o, lambda g: torch.rand(n, k, generator=g)),
        "KLDivLoss": (lambda: nn.KLDivLoss(reduction="batchmean"), lambda o: F.log_softmax(o, -1),
                      lambda g: torch.softmax(torch.randn(n, k, generator=g), -1)),
        "HuberLoss": (nn.HuberLoss, lambda o: o, lambda g: torch.randn(n, k, generator=g)),
        "SmoothL1Loss": (nn.SmoothL1Loss, lambda o: o, lambda g: torch.randn(n, k, generator=g)),
        "SoftMarginLoss": (nn.SoftMarginLoss, lambda o: o, lambda g: torch.randint(0, 2, (n, k), generator=g) * 2. - 1),
        "MultiLabelSoftMarginLoss": (nn.MultiLabelSoftMarginLoss, lambda o: o,
                                     lambda g: torch.randint(0, 2, (n, k), generator=g).float()),
        "MultiMarginLoss": (nn.MultiMarginLoss, lambda o: o, cls_target),
        "MultiLabelMarginLoss": (nn.MultiLabelMarginLoss, lambda o: o,
                                 lambda g: torch.cat([torch.randint(0, k, (n, 2), generator=g),
                                                      torch.full((n, k - 2), -1)], 1)),
        "HingeEmbeddingLoss": (nn.HingeEmbeddingLoss, lambda o: o,
                               lambda g: torch.randint(0, 2, (n, k), generator=g) * 2. - 1),
        "PoissonNLLLoss": (nn.PoissonNLLLoss, lambda o: o,
                           lambda g: torch.poisson(torch.rand(n, k, generator=g) * 3, generator=g)),
        "GaussianNLLLoss": (nn.GaussianNLLLoss, lambda o: o, lambda g: torch.randn(n, k, generator=g)),
        "CosineEmbeddingLoss": (nn.CosineEmbeddingLoss, lambda o: o, lambda g: torch.randint(0, 2, (n,), generator=g)
                                * 2. - 1),
        "MarginRankingLoss": (nn.MarginRankingLoss, lambda o: o, lambda g: torch.randint(0, 2, (n,), generator=g) * 2. - 1),
        "TripletMarginLoss": (nn.TripletMarginLoss, lambda o: o, lambda g: torch.randn(n, k, generator=g)),
        "TripletMarginWithDistanceLoss": (nn.TripletMarginWithDistanceLoss, lambda o: o,
                                          lambda g: torch.randn(n, k, generator=g)),
        "CTCLoss": (nn.CTCLoss, lambda o: o, None),
    }
    del gen
    out = []
    for name, (make_loss, transform, target) in losses.items():
        out.append(Arch(f"loss:{name}", "torch.nn", _loss_make(name, make_loss, transform, target, d, n, k), "loss"))
    return out


class _LossModel(nn.Module):
    def __init__(self, d: int, k: int, transform: Callable):
        super().__init__()
        self.fc = nn.Linear(d, k)
        self.transform = transform

    def forward(self, x):
        return self.transform(self.fc(x))


class _CTCModel(nn.Module):
    """A tiny acoustic model: (B, T, d) frames -> log-probabilities (T, B, C) for nn.CTCLoss."""

    def __init__(self, d: int = 16, classes: int = 6):
        super().__init__()
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.fc = nn.Linear(d, classes)

    def forward(self, x):
        return F.log_softmax(self.fc(self.rnn(x)[0]), -1).transpose(0, 1)


def _loss_make(name, make_loss, transform, target, d, n, k) -> Callable[[], Built]:
    def make() -> Built:
        torch.manual_seed(0)
        crit = make_loss()
        if name == "CTCLoss":
            model = _CTCModel(d)

            def batch(step):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(2, 12, d, generator=g)
                y = torch.randint(1, 6, (2, 4), generator=g)
                return x, y

            def loss_fn(out, y):
                return crit(out, y, torch.full((2,), 12, dtype=torch.long), torch.full((2,), 4, dtype=torch.long))
            return Built(model, batch, loss_fn)
        model = _LossModel(d, k, transform)
        pair = name in ("CosineEmbeddingLoss", "MarginRankingLoss", "TripletMarginLoss", "TripletMarginWithDistanceLoss",
                        "GaussianNLLLoss")

        def batch(step):
            g = torch.Generator().manual_seed(step)
            return torch.randn(n, d, generator=g), target(g)

        if not pair:
            return Built(model, batch, crit)

        def loss_fn(out, y):  # the losses of two or three inputs: halves of the output, or output and target
            if name == "GaussianNLLLoss":
                return crit(out, y, F.softplus(out) + 1e-3)
            if name == "MarginRankingLoss":
                return crit(out[:, 0], out[:, 1], y)
            if name == "CosineEmbeddingLoss":
                return crit(out[:, :2], out[:, 2:4], y)
            return crit(out, y, out.flip(0))
        return Built(model, batch, loss_fn)
    return make


# ---------------------------------------------------------------- CNN, RNN language models, diffusers

class ResNetBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 5, c: int = 8):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.layer1, self.layer2 = ResNetBlock(c), ResNetBlock(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(F.relu(self.bn(self.stem(x)))))
        return self.fc(x.mean((2, 3)))


class RNNLM(nn.Module):
    def __init__(self, cell: str, vocab: int = 64, d: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn = getattr(nn, cell)(d, d, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.rnn(self.embed(idx))[0])


def _lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _resnet() -> Built:
    torch.manual_seed(0)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)
    return Built(TinyResNet(), batch, F.cross_entropy)


def _rnnlm(cell: str) -> Callable[[], Built]:
    def make() -> Built:
        torch.manual_seed(0)

        def batch(step):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 64, (3, 10), generator=g)
            return idx, idx.roll(-1, 1)
        return Built(RNNLM(cell), batch, _lm_loss)
    return make


class _Denoise(nn.Module):
    """diffusers' UNet2DModel trained as DDPM does: predict the noise added at timestep t."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, noisy, t):
        return self.unet(noisy, t).sample


class _VAE(nn.Module):
    """diffusers' AutoencoderKL trained as a VAE: reconstruction + KL of the posterior."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae

    def forward(self, x):
        post = self.vae.encode(x).latent_dist
        z = post.sample()
        rec = self.vae.decode(z).sample
        return F.mse_loss(rec, x) + 1e-3 * post.kl().mean()


def _unet() -> Built:
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(16, 32), norm_num_groups=8,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"))

    def batch(step):
        g = torch.Generator().manual_seed(step)
        noise = torch.randn(2, 3, 16, 16, generator=g)
        return (torch.randn(2, 3, 16, 16, generator=g) * 0.7 + noise * 0.7, torch.randint(0, 1000, (2,), generator=g)), \
            noise
    return Built(_Denoise(unet), batch, F.mse_loss)


def _vae() -> Built:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
                        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), latent_channels=4,
                        norm_num_groups=8, sample_size=16)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(2, 3, 16, 16, generator=g), None
    return Built(_VAE(vae), batch, None)


def other_archs() -> list[Arch]:
    out = [Arch("cnn:resnet", "cnn", _resnet, "image_cls"),
           Arch("rnn:lstm_lm", "rnn", _rnnlm("LSTM"), "lm"), Arch("rnn:gru_lm", "rnn", _rnnlm("GRU"), "lm")]
    try:
        import diffusers  # noqa: F401
    except ImportError:
        return out
    return out + [Arch("diffusers:UNet2DModel", "diffusion", _unet, "denoise"),
                  Arch("diffusers:AutoencoderKL", "diffusion", _vae, "vae")]


def all_archs() -> list[Arch]:
    return other_archs() + nn_layer_archs() + hf_archs() + lib_archs()


def select(archs: list[Arch], names: list[str] | None, limit: int | None) -> list[Arch]:
    """Architectures whose name contains one of `names` (all if None), at most `limit` (spread evenly)."""
    if names:
        archs = [a for a in archs if any(n in a.name for n in names)]
    if limit is not None and len(archs) > limit:
        step = len(archs) / limit
        archs = [archs[math.floor(i * step)] for i in range(limit)]
    return archs
