"""Every snapshot the guard writes analyzes with no flags: one real training loop per family that used to
leave an unanalyzable snapshot, each analyzed in a fresh process where neither the training code nor
transformers can be imported (FSDP2 without `sync_ranks=`: tests/distributed, whose runs pass no flag).

* a cosine LambdaLR computed with numpy (`np.cos`): numpy floats in every param group and the scheduler;
* transformers' Wav2Vec2ForCTC (weight-norm positional convolution, CTC loss) from a tiny config: a short
  clip with a long transcript makes CTC's loss +inf; its step program replays equal to eager;
* a nanoGPT-style model (`forward(idx, targets) -> (logits, loss)`, a loop written like nanoGPT's train.py)
  given `loss_fn=F.cross_entropy`: one warning on the first step with the fix, and an analyzable snapshot;
* a Llama from a tiny config given a 4D additive mask built from transformers' own mask builder, with a
  fully padded sequence: -inf in the batch is a mask, replayed; softmax over the all-masked row is named.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from isolation import analyze_isolated, framework, load_training_code, marker_line

TRAINING_CODE = '''
import math
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from dataclasses import dataclass
from fractions import Fraction
from nanreplay import NanGuard


# ---- numpy cosine schedule
class LogFeatures(nn.Module):
    def forward(self, x):
        return torch.cat([x[:, :1], torch.log(x[:, 1:2].abs()), x[:, 2:]], 1)  # LINE: numpy log


def numpy_schedule(folder):
    torch.manual_seed(0)
    model = nn.Sequential(LogFeatures(), nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(np.float64(0.9), np.float64(0.95)))
    opt.param_groups[0].update(layer_id=np.int64(0), lr_scale=Fraction(1, 2))  # as layer-decay recipes add
    warmup, total = 2, 50
    cosine = lambda s: np.float64(s + 1) / warmup if s < warmup else 0.5 * (1 + np.cos(np.pi * s / total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder, scheduler=sched)
    g = torch.Generator().manual_seed(0)
    for step in range(8):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if step == 5:
            x[3, 1] = 0.0
        guard.begin(x, y, step=step)
        opt.zero_grad()
        if not guard.step(F.mse_loss(model(x), y)):
            break
        sched.step()
    return guard.last_snapshot, float(opt.param_groups[0]["lr"])


# ---- Wav2Vec2 + CTC
def wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    cfg = Wav2Vec2Config(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
                         layerdrop=0.0, pad_token_id=0, ctc_loss_reduction="mean")
    torch.manual_seed(0)
    return Wav2Vec2ForCTC(cfg).train()


def wav2vec2_ctc(folder):
    model = wav2vec2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, folder=folder)  # the model's own CTC loss
    g = torch.Generator().manual_seed(0)
    healthy = None
    for step in range(4):
        samples, chars = (1600, 5) if step < 2 else (400, 60)  # a short clip with a long transcript
        batch = {"input_values": torch.randn(2, samples, generator=g),
                 "labels": torch.randint(1, 12, (2, chars), generator=g)}
        guard.begin(batch, step=step)
        opt.zero_grad()
        out = model(**batch)
        if not guard.loss_ok(out.loss):
            break
        out.loss.backward()
        if step == 0:  # the eager loss and gradients, and the snapshot of this healthy step
            healthy = (float(out.loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                       guard.to_dict("loss"))
        if not guard.grads_ok():
            break
        opt.step()
    return guard.last_snapshot, healthy


# ---- nanoGPT: forward(idx, targets) -> (logits, loss); the loop as in nanoGPT's train.py
@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd, bias=config.bias), CausalSelfAttention(config)
        self.ln_2, self.mlp = nn.LayerNorm(config.n_embd, bias=config.bias), MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd), wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)  # LINE: ln_f
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss


def nanogpt(folder, gradient_accumulation_steps=2):
    torch.manual_seed(1337)
    model = GPT(GPTConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95))
    guard = NanGuard(model, optimizer, loss_fn=F.cross_entropy, folder=folder)  # as a user would write it
    data = torch.randint(0, 64, (4096,), generator=torch.Generator().manual_seed(0))

    def get_batch(it):
        ix = torch.randint(len(data) - 16, (4,), generator=torch.Generator().manual_seed(it))
        return torch.stack([data[i:i + 16] for i in ix]), torch.stack([data[i + 1:i + 17] for i in ix])

    it, X, Y = 0, *get_batch(0)
    for it in range(6):
        lr = 6e-4 * 0.5 * (1.0 + math.cos(math.pi * it / 6))
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if it == 4:  # a bad update, as a far too high learning rate would make: ln_f's gain explodes
            with torch.no_grad():
                model.transformer.ln_f.weight.fill_(3e38)
        for micro_step in range(gradient_accumulation_steps):
            guard.begin(X, Y, step=it, micro_batch=micro_step)
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            if not guard.loss_ok(loss):
                return guard.last_snapshot
            X, Y = get_batch(it * 10 + micro_step + 1)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not guard.grads_ok():
            return guard.last_snapshot
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return guard.last_snapshot


# ---- Llama with a 4D additive mask from transformers' own mask builder
def llama_mask(folder):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import and_masks, causal_mask_function, padding_mask_function, sdpa_mask
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, folder=folder)
    B, T = 3, 6
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        ids = torch.randint(0, 32, (B, T), generator=g)
        keep = torch.ones(B, T, dtype=torch.bool)
        keep[:, 5:] = False
        if step == 2:
            keep[1] = False  # a sequence that is all padding
        allowed = sdpa_mask(batch_size=B, q_length=T, kv_length=T, attention_mask=None, allow_is_causal_skip=False,
                            mask_function=and_masks(causal_mask_function, padding_mask_function(keep)))
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))  # additive, 0 / -inf
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(~keep, -100)}
        guard.begin(batch, step=step)
        opt.zero_grad()
        if not guard.step(model(**batch).loss):
            break
    return guard.last_snapshot
'''

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    framework("transformers")
    root = tmp_path_factory.mktemp("families")
    mod = load_training_code(root / "proj", "familymod", TRAINING_CODE)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["numpy"], out["numpy_lr"] = mod.numpy_schedule(str(root / "numpy"))
        out["ctc"], out["ctc_healthy"] = mod.wav2vec2_ctc(str(root / "ctc"))
        out["nanogpt"] = mod.nanogpt(str(root / "nanogpt"))
        out["mask"] = mod.llama_mask(str(root / "mask"))
    out["warnings"] = [str(w.message) for w in caught if "nanreplay" in str(w.message)]
    paths = [out[k] for k in ("numpy", "ctc", "nanogpt", "mask")]
    assert all(paths), (paths, out["warnings"])
    out["analyses"] = analyze_isolated(paths, root / "elsewhere", also_blocked=("familymod",))
    out["module"] = mod
    return out


def _only_data(x, where="snapshot"):
    """Every value is a tensor or plain JSON data (no numpy, no enum, no dataclass, nothing pickled)."""
    if isinstance(x, torch.Tensor) or x is None or type(x) in (bool, int, float, str):
        return
    assert type(x) in (dict, list, tuple), f"{where}: {type(x).__module__}.{type(x).__qualname__}"
    items = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
        assert type(k) in (str, int) or not isinstance(x, dict), f"{where}: key {k!r}"
        _only_data(v, f"{where}[{k!r}]")


def _needs_no_pickle(path):
    allowed = [repr(g) for g in torch.serialization.get_safe_globals()]  # (torch.distributed adds its own)
    assert not [g for g in allowed if "numpy" in g or "fractions" in g or "decimal" in g], allowed
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    d = torch.load(path, weights_only=True)
    _only_data(d)
    return d


def test_every_snapshot_is_only_data(runs):
    for key in ("numpy", "ctc", "nanogpt", "mask"):
        _needs_no_pickle(runs[key])


def test_numpy_schedule_snapshot_needs_no_pickle_and_names_the_log(runs):
    d = _needs_no_pickle(runs["numpy"])
    group = d["optimizer"]["state_dict"]["param_groups"][0]
    assert type(group["lr"]) is float and math.isclose(group["lr"], runs["numpy_lr"], rel_tol=1e-9)
    assert group["betas"] == [0.9, 0.95] and type(group["betas"][1]) is float
    assert type(group["layer_id"]) is int and group["lr_scale"] == 0.5
    assert all(type(r.get("lr")) is float for r in d["history"] if r.get("lr") is not None)
    a = runs["analyses"][runs["numpy"]]
    assert a["verdict"] == "culprit_found", a["verdict"]
    assert a["culprit"]["source"]["line"] == marker_line(TRAINING_CODE, "numpy log")


def test_the_update_snapshot_of_a_numpy_schedule_is_only_data(tmp_path):
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: np.float64(np.inf) if s == 2 else np.cos(0.1 * s))
    from nanreplay import NanGuard

    guard = NanGuard(model, opt, loss_fn=torch.nn.functional.mse_loss, folder=tmp_path, scheduler=sched)
    for step in range(4):
        x, y = torch.randn(4, 3), torch.randn(4, 1)
        guard.begin(x, y, step=step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not guard.step(torch.nn.functional.mse_loss(model(x), y)):
                break
        sched.step()
    assert guard.last_trigger == "update" and guard.last_snapshot
    d = _needs_no_pickle(guard.last_snapshot)
    assert d["update"]["groups"][0]["hyper"]["lr"] == math.inf
    assert d["update"]["scheduler"]["class"] == "LambdaLR"


def test_wav2vec2_ctc_records_a_program_that_replays_equal_to_eager(runs, tmp_path):
    from nanreplay.formats.native import parse, rebuild_subject

    loss, grads, d = runs["ctc_healthy"]
    assert d["step_program"] is not None, d["program_error"]
    ops = {n["op"] for n in __import__("json").loads(d["step_program"])["nodes"]}
    assert {"aten._weight_norm_interface.default", "aten._ctc_loss.Tensor"} <= ops
    path = tmp_path / "healthy.pt"
    torch.save(d, path)
    snap = parse(str(path), torch.load(path, weights_only=True))
    subject = rebuild_subject(snap, model=None, loss=None, device=None, trust=False)
    subject.prepare()
    replayed = subject.model(subject.inputs, subject.target)
    replayed.backward()
    assert float(replayed) == loss  # CPU kernels are deterministic: bit for bit
    got = {n: p.grad for n, p in subject.model.named_parameters() if p.grad is not None}
    assert got.keys() == grads.keys()
    assert [n for n, g in grads.items() if not torch.equal(got[n], g)] == []


def test_wav2vec2_ctc_inf_is_named_at_the_ctc_loss(runs):
    a = runs["analyses"][runs["ctc"]]
    assert a["model"]["how"].startswith("step program"), a["model"]["how"]
    assert a["verdict"] == "culprit_found" and a["culprit"]["op"] == "aten._ctc_loss.Tensor"
    assert a["culprit"]["kind"] == "inf" and a["culprit"]["phase"] == "forward"


def test_nanogpt_with_a_loss_fn_that_does_not_fit_warns_once_and_still_records(runs):
    said = [w for w in runs["warnings"] if "loss_fn=F.cross_entropy" in w]
    assert len(said) == 1, runs["warnings"]
    assert "pass loss_fn=None" in said[0] and "(tensor[4, 16, 64], scalar)" in said[0]
    d = _needs_no_pickle(runs["nanogpt"])
    assert d["step_program"] is not None, d["program_error"]
    assert d["loss_spec"] == {"kind": "output"} and any("pass loss_fn=None" in n for n in d["notes"])
    assert len(d["batch"]["inputs"]) == 2  # the call the loop made: model(X, Y), not begin()'s model(X)
    a = runs["analyses"][runs["nanogpt"]]
    assert a["verdict"] == "culprit_found", a["verdict"]
    assert a["culprit"]["module"] == "transformer.ln_f" and a["culprit"]["phase"] == "forward"
    assert a["culprit"]["source"]["line"] == marker_line(TRAINING_CODE, "ln_f")


def test_a_4d_additive_mask_is_replayed_and_the_all_masked_softmax_is_named(runs):
    a = runs["analyses"][runs["mask"]]
    assert a["verdict"] == "culprit_found", (a["verdict"], a["nonfinite_leaves"])
    (mask,) = a["nonfinite_leaves"]
    assert mask["literal"] is True and mask["nan"] == 0 and "attention_mask" in mask["name"]
    c = a["culprit"]
    assert c["op"] == "aten._softmax.default" and c["module"] == "model.layers.0.self_attn"
    assert "softmax" in c["source"]["code"] and a["diagnosis"]["cause"] == "softmax_all_masked"
    assert [e["role"] for e in a["chain"][:2]] == ["literal", "conversion"]


def test_nan_or_plus_inf_in_a_mask_is_still_a_bad_input(runs, tmp_path):
    from nanreplay.analysis import analyze

    for bad in (float("nan"), float("inf")):
        d = torch.load(runs["mask"], weights_only=True)
        d["batch"]["inputs"]["attention_mask"][2, 0, 3, 0] = bad
        path = tmp_path / f"bad_{bad}.pt"
        torch.save(d, path)
        a = analyze(path, verify=False).to_json()
        assert a["verdict"] == "nonfinite_input", a["verdict"]
        (row,) = [r for r in a["nonfinite_leaves"] if not r.get("literal")]
        assert "attention_mask" in row["name"] and row["samples"] == [2]  # not every masked sample
