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

import contextlib
import io
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

B, T = 2, 8  # batch size, sequence length of the text models
MAX_PARAMS = 3_000_000


@dataclass
class Built:
    """One architecture, ready to train: `model(inputs)` then `loss_fn(output, target)` (None: the model's own)."""

    model: nn.Module
    batch: Callable[[int], tuple[Any, Any]]  # step -> (inputs, target), deterministic per step
    loss_fn: Callable | None = None
    attention: list[str] = field(default_factory=list)  # module paths that compute attention (fault sites)
    image: bool = False  # inputs are images / waveforms (a float batch), not token ids


@dataclass
class Arch:
    name: str  # "hf:llama" / "nn:LSTM" / "cnn:resnet" / "diffusers:UNet2DModel"
    family: str  # decoder, encoder, encoder-decoder, vision, audio, moe, state-space, diffusion, torch.nn, cnn, rnn
    make: Callable[[], Built]
    head: str = ""


class Skipped(Exception):
    """This architecture cannot be built or trained here; the message says why."""


# ---------------------------------------------------------------- transformers

HEADS = (  # (head, mapping, family of the head); a model type trains with its first head here (audio first:
    # whisper also has a causal-LM head, but it is a speech model)
    ("ctc", "MODEL_FOR_CTC_MAPPING_NAMES", "audio"),
    ("speech_seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "audio"),
    ("audio_cls", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "audio"),
    ("causal_lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "decoder"),
    ("masked_lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "encoder"),
    ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "encoder-decoder"),
    ("seq_cls", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "encoder"),
    ("image_cls", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "vision"),
)
STATE_SPACE = ("mamba", "rwkv", "rrwkv", "zamba", "bamba", "jamba", "falcon_h1", "granitemoehybrid", "lfm2", "xlstm",
               "recurrent_gemma", "nemotron_h", "qwen3_next", "minimax", "plamo2")
MOE_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")

# attribute -> tiny value, set wherever a config has the attribute
SCALARS = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "dim": 32, "embed_dim": 32, "embedding_size": 32,
    "word_embed_proj_dim": 32, "projection_dim": 32, "hidden_dim": 32, "d_embed": 32, "n_embed": 32,
    "intermediate_size": 64, "ffn_dim": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_ff": 64,
    "n_inner": 64, "d_inner": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "ffn_hidden_size": 64, "mlp_dim": 64, "hidden_dim_ffn": 64,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "num_encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "kv_channels": 8, "attention_head_dim": 8,
    "vocab_size": 256, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1,
    "image_size": 32, "patch_size": 8, "num_channels": 3,
    "conv_dim": None, "conv_kernel": None, "conv_stride": None,  # audio feature extractors: handled below
    "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4, "tdnn_dim": None,
    "max_position_embeddings": 64, "n_positions": 64, "max_seq_len": 64, "n_ctx": 64,
    "use_cache": False, "num_labels": 3, "layer_types": None,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "state_size": 8, "ssm_state_size": 8, "d_state": 8, "expand": 2, "time_step_rank": 4, "n_groups": 1,
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_expand": 2,
    "num_buckets": 32, "max_relative_positions": 32, "position_buckets": 32, "relative_attention_num_buckets": 8,
    "sliding_window": 16, "attention_window": 4, "window_size": 2, "rotary_dim": 4, "num_groups": 4, "width_coefficient": 0.25,
    "hidden_dim_size": 32, "max_source_positions": 16, "max_target_positions": 64, "num_mel_bins": 16,
}
SCALE_LISTS = {  # list attributes: (value for stage i)
    "hidden_sizes": lambda i, v: 8 * 2 ** i, "depths": lambda i, v: 1, "embed_dims": lambda i, v: 8 * 2 ** i,
    "num_heads": lambda i, v: 2 ** i if v else v,
}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id",
             "mask_token_id", "unk_token_id", "image_token_id", "boi_token_id", "eoi_token_id")


def _mappings() -> list[tuple[str, str, str, str]]:
    """(model_type, class name, head, family) for each model type, its first head in HEADS order."""
    import transformers.models.auto.modeling_auto as ma

    seen: dict[str, tuple[str, str, str, str]] = {}
    for head, mapping, family in HEADS:
        for model_type, cls in getattr(ma, mapping).items():
            if isinstance(cls, (tuple, list)):
                cls = cls[0]
            if model_type not in seen:
                seen[model_type] = (model_type, cls, head, family)
    return sorted(seen.values())


def _set(cfg, name: str, value) -> None:
    try:
        setattr(cfg, name, value)
    except Exception:  # noqa: BLE001,S110 - a derived property, or one this config validates: left as it is
        pass


def _get(cfg, name: str):
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - per-layer attributes raise on a global read
        return None


def _shrink(cfg) -> None:
    for name, value in SCALARS.items():
        old = _get(cfg, name)
        if value is None or old is None:
            continue
        if isinstance(old, bool) or isinstance(value, bool):
            _set(cfg, name, value)
        elif isinstance(old, int) and old > 0 and isinstance(value, int):
            if name == "num_key_value_heads":
                value = min(value, _get(cfg, "num_attention_heads") or value)
            _set(cfg, name, min(old, value) if name not in ("image_size", "num_labels") else value)
    vocab = _get(cfg, "vocab_size")
    if isinstance(vocab, int):
        for i, t in enumerate(TOKEN_IDS):  # special tokens of the full vocabulary: small ids of the tiny one
            v = _get(cfg, t)
            if isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
                _set(cfg, t, min(i, vocab - 1))
            elif isinstance(v, list) and any(isinstance(x, int) and x >= vocab for x in v):
                _set(cfg, t, [min(i, vocab - 1)])
    for name, f in SCALE_LISTS.items():
        old = _get(cfg, name)
        if isinstance(old, (list, tuple)) and old and all(isinstance(v, int) for v in old):
            _set(cfg, name, type(old)(f(i, v) for i, v in enumerate(old)))
    conv = _get(cfg, "conv_dim")
    if isinstance(conv, (list, tuple)):  # wav2vec2-style feature extractor
        _set(cfg, "conv_dim", [16] * len(conv))
    tdnn = _get(cfg, "tdnn_dim")
    if isinstance(tdnn, (list, tuple)):
        _set(cfg, "tdnn_dim", [16] * len(tdnn))
        _set(cfg, "xvector_output_dim", 16)
    layers = _get(cfg, "num_hidden_layers")
    types = _get(cfg, "layer_types")
    if isinstance(types, list) and isinstance(layers, int):
        _set(cfg, "layer_types", types[:layers])
    if _get(cfg, "is_encoder_decoder") and _get(cfg, "decoder_start_token_id") is None:
        _set(cfg, "decoder_start_token_id", _get(cfg, "pad_token_id") or 0)  # (v5 keeps it in generation_config)
    for t in ("text_config", "vision_config", "audio_config", "encoder", "decoder"):
        sub = _get(cfg, t)
        if sub is not None and hasattr(sub, "to_dict") and sub is not cfg:
            _shrink(sub)


def _hf_batch(head: str, cfg, gen_seed: int, step: int):
    g = torch.Generator().manual_seed(gen_seed * 1000 + step)
    vocab = int(getattr(cfg, "vocab_size", 256) or 256)
    lo = min(10, vocab - 1)
    if head in ("causal_lm", "masked_lm", "seq2seq", "seq_cls"):
        ids = torch.randint(lo, vocab, (B, T), generator=g)
        if head == "seq_cls":
            labels = torch.randint(0, cfg.num_labels, (B,), generator=g)
        elif head == "masked_lm":
            labels = ids.clone()
        else:
            labels = torch.randint(lo, vocab, (B, T), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long), "labels": labels}
    if head == "image_cls":
        size = getattr(cfg, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        ch = getattr(cfg, "num_channels", 3)
        return {"pixel_values": torch.randn(B, ch, size, size, generator=g),
                "labels": torch.randint(0, cfg.num_labels, (B,), generator=g)}
    if head == "speech_seq2seq":  # whisper-style log-mel features: (batch, mel bins, 2 x encoder positions)
        frames = 2 * int(getattr(cfg, "max_source_positions", 16))
        return {"input_features": torch.randn(B, cfg.num_mel_bins, frames, generator=g),
                "labels": torch.randint(lo, vocab, (B, T), generator=g)}
    n = 4000  # samples of a waveform: a dozen frames after the feature extractor
    x = {"input_values": torch.randn(B, n, generator=g)}
    if head == "ctc":
        x["labels"] = torch.randint(1, min(vocab, 30), (B, 3), generator=g)
    else:
        x["labels"] = torch.randint(0, cfg.num_labels, (B,), generator=g)
    return x


def _hf_family(model_type: str, cfg, head_family: str) -> str:
    if any(s in model_type for s in STATE_SPACE):
        return "state-space"
    if any(isinstance(getattr(cfg, a, None), int) and getattr(cfg, a) > 1 for a in MOE_ATTRS):
        return "moe"
    return head_family


def _hf_make(model_type: str, cls_name: str, head: str) -> Callable[[], Built]:
    def make() -> Built:
        import transformers
        from transformers import CONFIG_MAPPING

        torch.manual_seed(0)
        cfg = CONFIG_MAPPING[model_type]()
        _shrink(cfg)
        cls = getattr(transformers, cls_name, None)
        if cls is None:
            raise Skipped(f"transformers has no class {cls_name}")
        with _quiet():
            with torch.device("meta"):  # sized first, without allocating: some configs stay large
                n = sum(p.numel() for p in _construct(cls, cfg).parameters())
            if n > MAX_PARAMS:
                raise Skipped(f"{n / 1e6:.1f}M parameters after shrinking the config (limit {MAX_PARAMS / 1e6:.0f}M)")
            torch.manual_seed(0)
            model = _construct(cls, cfg)
        model.train()
        cfg = model.config
        attention = [name for name, m in model.named_modules()
                     if type(m).__name__.endswith(("Attention", "SelfAttention", "Attention2")) and name]
        return Built(model, lambda step: (_hf_batch(head, cfg, 0, step), None), None, attention,
                     image=head in ("image_cls", "ctc", "audio_cls", "speech_seq2seq"))
    return make


def _construct(cls, cfg):
    return cls._from_config(cfg) if hasattr(cls, "_from_config") else cls(cfg)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def hf_archs() -> list[Arch]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return []
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    out = []
    for model_type, cls_name, head, family in _mappings():
        if model_type not in CONFIG_MAPPING:
            continue
        try:
            cfg = CONFIG_MAPPING[model_type]()
            fam = _hf_family(model_type, cfg, family)
        except Exception:  # noqa: BLE001 - the config itself cannot be built: make() says why
            fam = family
        out.append(Arch(f"hf:{model_type}", fam, _hf_make(model_type, cls_name, head), head))
    return out


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
        return Built(m, batch, regression_loss, image=ints is None)
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
        "PoissonNLLLoss": (nn.PoissonNLLLoss, lambda o: o, lambda g: torch.poisson(torch.rand(n, k, generator=g) * 3, generator=g)),
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
            return Built(model, batch, loss_fn, image=True)
        model = _LossModel(d, k, transform)
        pair = name in ("CosineEmbeddingLoss", "MarginRankingLoss", "TripletMarginLoss", "TripletMarginWithDistanceLoss",
                        "GaussianNLLLoss")

        def batch(step):
            g = torch.Generator().manual_seed(step)
            return torch.randn(n, d, generator=g), target(g)

        if not pair:
            return Built(model, batch, crit, image=True)

        def loss_fn(out, y):  # the losses of two or three inputs: halves of the output, or output and target
            if name == "GaussianNLLLoss":
                return crit(out, y, F.softplus(out) + 1e-3)
            if name == "MarginRankingLoss":
                return crit(out[:, 0], out[:, 1], y)
            if name == "CosineEmbeddingLoss":
                return crit(out[:, :2], out[:, 2:4], y)
            return crit(out, y, out.flip(0))
        return Built(model, batch, loss_fn, image=True)
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
    return Built(TinyResNet(), batch, F.cross_entropy, image=True)


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
    return Built(_Denoise(unet), batch, F.mse_loss, image=True)


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
    return Built(_VAE(vae), batch, None, image=True)


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
    return other_archs() + nn_layer_archs() + hf_archs()


def select(archs: list[Arch], names: list[str] | None, limit: int | None) -> list[Arch]:
    """Architectures whose name contains one of `names` (all if None), at most `limit` (spread evenly)."""
    if names:
        archs = [a for a in archs if any(n in a.name for n in names)]
    if limit is not None and len(archs) > limit:
        step = len(archs) / limit
        archs = [archs[math.floor(i * step)] for i in range(limit)]
    return archs
