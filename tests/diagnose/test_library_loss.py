"""transformers' own causal-LM loss (`reduction='mean'`, no `num_items_in_batch`) on a batch whose labels are all
-100: the culprit is `nll_loss_forward` inside site-packages, replayed from the step program as the aten op itself.
The empty-reduction fix must be applied there, at the op (never a rewrite of the library's line), and verify."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nanreplay import NanGuard  # noqa: E402
from nanreplay.confine import analyze as confined  # noqa: E402


def test_all_ignored_labels_in_the_library_loss_get_a_verified_op_level_fix(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, folder=tmp_path)  # the model computes its own loss
    for step in range(4):
        ids = torch.randint(0, 64, (2, 16))
        labels = ids.clone()
        labels[:, : (16 if step == 3 else 10)] = -100  # step 3: every prompt truncated past its answer
        batch = {"input_ids": ids, "labels": labels}
        guard.begin(batch, step=step)
        opt.zero_grad()
        loss = model(**batch).loss
        if not guard.loss_ok(loss):
            break
        loss.backward()
        opt.step()
    assert guard.last_snapshot
    d = confined(guard.last_snapshot)
    assert "step program" in d["model"]["how"]
    assert d["culprit"]["op"] == "aten.nll_loss_forward.default"
    assert "site-packages" in d["culprit"]["source"]["file"] or "transformers" in d["culprit"]["source"]["file"]
    fix = d["diagnosis"]["fix"]
    assert d["diagnosis"]["title"] == "cross-entropy mean over zero targets (all ignore_index)"
    assert fix["verified"] is True and fix["tested_as"] == "op", fix["verification"]
    assert fix["patched_ops"] == ["aten.nll_loss_forward.default"] and fix["after"] is None
