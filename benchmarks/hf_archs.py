"""Every model type of the installed transformers, from its own auto-model mappings, built from a tiny config.

The config class comes from CONFIG_MAPPING; the common size attributes are shrunk wherever a config has them
(hidden sizes, layers, heads, experts, vocabulary, image size); special token ids of the full vocabulary become
small ids of the tiny one. No weights are downloaded: random init, synthetic batches for each head.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable

import torch
from arch_types import Arch, Built, Skipped

B, T = 2, 8  # batch size, sequence length of the text models
MAX_PARAMS = 3_000_000


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
        return Built(model, lambda step: (_hf_batch(head, cfg, 0, step), None), None)
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
