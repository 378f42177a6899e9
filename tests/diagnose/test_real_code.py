"""Diagnosis on real framework code, analyzed where neither the training code nor transformers can be imported:

* transformers' own causal-LM loss (`loss / num_items_in_batch`) on a batch whose labels are all -100: a count
  of 0 — an empty reduction, not a zero norm — inside library code: the fix clamps the count (verified by an
  op-level patch; no line of site-packages is rewritten) and the advice is about the data;
* a masked mean over zero tokens in the user's loss, the mask a product of two 0/1 masks: the same cause;
* a Llama RMSNorm without eps (`rms_norm_eps=0`) meeting an all-zero hidden row: rsqrt(0), from the domain
  table, inside the library: the fix is the layer's eps, verified by replay;
* a T5 under fp16 autocast whose cross-attention query overflows: T5 makes its position bias with
  `torch.zeros(..., dtype=query_states.dtype)`, a float16 literal that must follow every replay's dtype (else
  the fp32/bf16/fp64 rows and the bf16 fix raise "mask dtype ≠ query dtype");
* CLIP with a runaway `logit_scale` (exp(100) overflows): every candidate patch lands on the culprit's exp,
  none raises (a patch keyed by call number once met `arange` in a second replay of the same copy); the bound
  that verifies is said as a clamp of the learned parameter itself.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from isolation import ROOT, analyze_isolated, framework, marker_line

pytestmark = pytest.mark.integrations

TRAINING = r'''
import sys
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM
from nanreplay import NanGuard


def tiny_llama(eps=1e-6):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=eps)
    return LlamaForCausalLM(cfg)


def all_masked(folder):
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, folder=folder)
    for step in range(4):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        labels = ids.clone()
        if step == 2:
            labels[:] = -100  # a prompt truncated past its answer: nothing left to predict
        n = (labels[:, 1:] != -100).sum()
        batch = {"input_ids": ids, "labels": labels, "num_items_in_batch": n}
        guard.begin(batch, step=step)
        opt.zero_grad()
        if not guard.step(model(**batch).loss):
            break
    return guard.last_snapshot


def token_loss(pred, target):
    y, attn, keep = target
    m = attn * keep  # positions that are real tokens and carry a label
    return ((pred.squeeze(-1) - y) ** 2 * m).sum() / m.sum()  # LINE: masked mean


def masked_mean(folder):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=token_loss, folder=folder)
    for step in range(4):
        x, y = torch.randn(2, 6, 4), torch.randn(2, 6)
        attn, keep = torch.ones(2, 6), (torch.rand(2, 6) > 0.3).float()
        if step == 2:
            keep.zero_()  # no position carries a label in this batch
        guard.begin(x, (y, attn, keep), step=step)
        opt.zero_grad()
        if not guard.step(token_loss(model(x), (y, attn, keep))):
            break
    return guard.last_snapshot


def rmsnorm_no_eps(folder):
    model = tiny_llama(eps=0.0)
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = 0.0  # a token whose embedding is all zero
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, folder=folder)
    for step in range(4):
        ids = torch.randint(6, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        if step == 2:
            ids[0, 3] = 5
        guard.begin({"input_ids": ids, "labels": ids}, step=step)
        opt.zero_grad()
        if not guard.step(model(input_ids=ids, labels=ids).loss):
            break
    return guard.last_snapshot


def t5_fp16(folder):
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
                   dropout_rate=0.0)
    model = T5ForConditionalGeneration(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, folder=folder)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        batch = {"input_ids": torch.randint(1, 64, (2, 8), generator=g), "labels": torch.randint(1, 64, (2, 6), generator=g)}
        if step == 2:
            with torch.no_grad():
                model.decoder.block[0].layer[1].EncDecAttention.q.weight.mul_(1e5)  # its query overflows fp16
        guard.begin(batch, step=step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        if not guard.step(loss):
            break
    return guard.last_snapshot


def clip_logit_scale(folder):
    from transformers import CLIPConfig, CLIPModel
    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=16),
                     vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=8, patch_size=4), projection_dim=8)
    model = CLIPModel(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, folder=folder)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        batch = {"input_ids": torch.randint(1, 64, (2, 6), generator=g),
                 "pixel_values": torch.randn(2, 3, 8, 8, generator=g), "return_loss": True}
        if step == 2:
            with torch.no_grad():
                model.logit_scale.fill_(100.0)  # a learned temperature that ran away: exp(100) overflows float32
        guard.begin(batch, step=step)
        opt.zero_grad()
        if not guard.step(model(**batch).loss):
            break
    return guard.last_snapshot


if __name__ == "__main__":
    for kind in sys.argv[2:]:
        print(kind, globals()[kind](f"{sys.argv[1]}/{kind}"))
'''

KINDS = ("all_masked", "masked_mean", "rmsnorm_no_eps", "t5_fp16", "clip_logit_scale")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    framework("transformers")
    root = tmp_path_factory.mktemp("realcode")
    proj = root / "proj"
    proj.mkdir()
    (proj / "realtrain.py").write_text(TRAINING)
    res = subprocess.run([sys.executable, "realtrain.py", str(root), *KINDS], cwd=proj, capture_output=True, text=True,
                         timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    paths = dict(ln.split() for ln in res.stdout.splitlines() if ln.split() and ln.split()[0] in KINDS)
    assert set(paths) == set(KINDS) and all(p.endswith(".pt") for p in paths.values()), res.stdout
    out = analyze_isolated(list(paths.values()), root / "elsewhere", also_blocked=("realtrain",))
    return {k: out[paths[k]] for k in KINDS}


def _no_library_edit(fix: dict) -> None:
    """No line of the library is rewritten: the fix is said in words and replayed as an op-level patch."""
    assert fix["before"] is None and fix["after"] is None and fix["tested_as"] == "op", fix
    assert all(ln.startswith("#") for ln in fix["code"].splitlines()), fix["code"]


def test_transformers_loss_with_every_label_masked_is_an_empty_reduction(runs):
    d = runs["all_masked"]
    assert d["verdict"] == "culprit_found" and d["culprit"]["op"].startswith("aten.div")
    src = d["culprit"]["source"]
    assert src["file"].endswith("transformers/loss/loss_utils.py"), src
    diag = d["diagnosis"]
    assert diag["cause"] == "empty_reduction", (diag["cause"], diag["title"])
    assert "num_items_in_batch" in diag["explanation"] and "nothing to average" in diag["explanation"]
    fix = diag["fix"]
    assert fix["kind"] == "guard_empty_reduction" and fix["verified"] is True, fix["verification"]
    assert "num_items_in_batch.clamp_min(1)" in fix["code"] and "transformers/loss/loss_utils.py:47" in fix["code"]
    _no_library_edit(fix)


def test_a_masked_mean_over_zero_tokens_is_an_empty_reduction(runs):
    d = runs["masked_mean"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "masked mean")
    diag = d["diagnosis"]
    assert diag["cause"] == "empty_reduction" and "normalize" not in diag["title"]
    fix = diag["fix"]
    assert fix["verified"] is True and ".clamp_min(1)" in fix["after"], fix["verification"]
    assert "in token_loss(), the loss/step code" in diag["explanation"]  # not "the model's own forward"


def test_rmsnorm_without_eps_is_rsqrt_at_zero_fixed_by_the_layers_eps(runs):
    d = runs["rmsnorm_no_eps"]
    assert d["culprit"]["forward_op"] == "aten.rsqrt.default", d["culprit"]
    assert "/transformers/" in d["culprit"]["source"]["file"]
    diag = d["diagnosis"]
    assert diag["cause"] == "domain_edge" and "rsqrt" in diag["title"]
    assert "eps" in diag["explanation"] and "config" in diag["explanation"]
    fix = diag["fix"]
    assert fix["verified"] is True, fix["verification"]
    _no_library_edit(fix)


def _no_internal_error(d: dict) -> None:
    """No fix candidate raised: a candidate that breaks the step's code is nanreplay's bug, not a result."""
    assert not d["diagnosis"].get("internal_errors") and not any("internal error" in w for w in d["warnings"]), d
    assert not any("raised" in (c.get("verification") or "") for c in d["diagnosis"]["candidates"]), \
        [c["verification"] for c in d["diagnosis"]["candidates"]]


def test_t5_under_fp16_autocast_replays_in_every_dtype(runs):
    d = runs["t5_fp16"]
    assert d["culprit"]["module"] == "decoder.block.0.layer.1.EncDecAttention.q", d["culprit"]
    rows = {r["dtype"]: r for r in d["precision"]}
    assert set(rows) == {"float32 (autocast off)", "autocast bfloat16", "float64"}, rows
    for r in rows.values():  # the fp16 position bias follows each replay's dtype: no "mask dtype" error
        assert "error" not in r and r["loss_finite"] and r["grads_finite"], r
    diag = d["diagnosis"]
    assert diag["cause"] == "fp16_overflow"
    fix = diag["fix"]
    assert fix["kind"] == "bf16_or_grad_scaler" and fix["verified"] is True, fix["verification"]
    _no_internal_error(d)


def test_clip_logit_scale_patches_land_on_the_culprits_exp(runs):
    d = runs["clip_logit_scale"]
    c = d["culprit"]
    assert c["op"] == "aten.exp.default" and c["source"]["file"].endswith("transformers/models/clip/modeling_clip.py")
    assert "logit_scale.exp()" in c["source"]["code"]
    cands = [f for f in d["diagnosis"]["candidates"] if f["patched_calls"]]
    assert len(cands) >= 2, d["diagnosis"]["candidates"]
    for f in cands:  # each patch met the culprit call itself, and nothing else
        assert f["patched_ops"] == ["aten.exp.default"], (f["code"], f["patched_ops"])
    fix = d["diagnosis"]["fix"]  # a bound tight enough for the logits exp scales (CLIP's own cap is ln 100)
    assert fix["kind"] == "clamp" and fix["verified"] is True, fix["verification"]
    assert "model.logit_scale.clamp_(max=" in fix["code"], fix["code"]  # what a user can change: the parameter
    _no_internal_error(d)
