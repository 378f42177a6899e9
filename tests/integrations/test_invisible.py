"""The guard is invisible: guard on vs off, the same K steps of real loops on real library code give bitwise-equal
losses, weights, buffers, gradients and RNG state, and no exception (same machine, same computation).

Each family used to die or lose its snapshot when the guard re-ran the step between the loop's forward and its
backward (restoring buffers with `copy_` bumped the version counter of a tensor the loop's graph had saved):

* a BertForSequenceClassification from a tiny config under a Hugging Face Trainer subclass with its own
  `compute_loss`, guarded with `nanreplay.transformers.attach(trainer)` (BERT's `token_type_ids` buffer);
* a BatchNorm CNN under `NanGuard(step_fn=...)`, Lightning's callback and Accelerate's `guard_for`
  (BatchNorm's running statistics);
* a minGPT-style model returning `(logits, None)` given `NanGuard(loss_fn=loss_fn)`: the guard finds the element
  the loop gave its loss and records the step through it.

Each family also runs once with a fault (a zero temperature, all-ignored labels); its snapshot is analyzed with no
flags in a fresh process where neither the training code nor the frameworks can be imported.
"""

from __future__ import annotations

import pytest
import torch
from isolation import analyze_isolated, framework, load_training_code

pytestmark = pytest.mark.integrations

TRAINING_CODE = '''
import random
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from nanreplay import NanGuard

K = 3


def fingerprint(model, losses, grads):
    """Everything a guard could have changed: losses, weights and buffers, the last step's gradients, RNG."""
    return {"losses": [float(v) for v in losses],
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grads": grads,
            "rng": (torch.get_rng_state(), random.getstate()[1], np.random.get_state()[1].copy())}


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def seed():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2), nn.Flatten(),
                                  nn.Linear(8 * 6 * 6, 4))

    def forward(self, x):
        return self.body(x)


def images(step, fault_step=None):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    return x, y, torch.tensor(0.0 if step == fault_step else 1.0)


def tempered(model, batch):
    x, y, temperature = batch
    return F.cross_entropy(model(x) / temperature, y)  # LINE: tempered


# ---- a BatchNorm CNN under step_fn
def cnn_step_fn(folder, guarded, fault_step=None):
    seed()
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = NanGuard(model, opt, step_fn=tempered, folder=folder) if guarded else None
    losses, grads = [], None
    for step in range(K):
        batch = images(step, fault_step)
        if guard:
            guard.begin(batch, step=step)
        opt.zero_grad()
        loss = tempered(model, batch)
        losses.append(loss.item())
        if guard and not guard.loss_ok(loss):
            break
        loss.backward()
        if guard and not guard.grads_ok():
            break
        grads = grads_of(model)
        opt.step()
    return fingerprint(model, losses, grads), guard and guard.last_snapshot


# ---- minGPT: logits, _ = model(X); loss = loss_fn(logits, Y)
class GPT(nn.Module):
    def __init__(self, vocab=16, dim=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, 8, dim))
        self.drop = nn.Dropout(0.1)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.temperature = 1.0

    def forward(self, idx, targets=None):
        h = self.drop(self.tok(idx) + self.pos[:, :idx.shape[1]])
        logits = self.head(self.ln(h)) / self.temperature  # LINE: gpt temperature
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def mingpt(folder, guarded, fault_step=None):
    seed()
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=gpt_loss, folder=folder) if guarded else None
    losses, grads = [], None
    for step in range(K):
        g = torch.Generator().manual_seed(step)
        X, Y = torch.randint(0, 16, (4, 8), generator=g), torch.randint(0, 16, (4, 8), generator=g)
        model.temperature = 0.0 if step == fault_step else 1.0
        if guard:
            guard.begin(X, Y, step=step)
        logits, _ = model(X)
        loss = gpt_loss(logits, Y)
        losses.append(loss.item())
        if guard and not guard.loss_ok(loss):
            break
        model.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads = grads_of(model)
        opt.step()
    return fingerprint(model, losses, grads), guard and guard.last_snapshot


# ---- Lightning + BatchNorm
def lightning_cnn(folder, guarded, fault_step=None):
    import lightning.pytorch as L
    from nanreplay.lightning import NanGuardCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = ConvNet()
            self.losses, self.grads = [], None

        def training_step(self, batch, batch_idx):
            loss = tempered(self.net, batch)
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.grads = grads_of(self)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    seed()
    module = Module()
    data = [images(step, fault_step) for step in range(K)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    callbacks = [NanGuardCallback(folder)] if guarded else []
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    try:
        trainer.fit(module, loader)
    except Exception as e:
        if type(e).__name__ != "TrainingStopped":
            raise
    return fingerprint(module, module.losses, module.grads), guarded and callbacks[0].guard.last_snapshot


# ---- Accelerate + BatchNorm
def accelerate_cnn(folder, guarded, fault_step=None):
    from accelerate import Accelerator
    from nanreplay.accelerate import guard_for

    accelerator = Accelerator(cpu=True)
    seed()
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = [images(step, fault_step) for step in range(K)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    guard = guard_for(accelerator, model, optimizer, step_fn=tempered, folder=folder) if guarded else None
    losses, grads = [], None
    for batch in loader:
        with accelerator.accumulate(model):
            if guard:
                guard.begin(batch)
            loss = tempered(model, batch)
            losses.append(loss.item())
            if guard and not guard.loss_ok(loss):
                break
            accelerator.backward(loss)
            if guard and not guard.grads_ok():
                break
            grads = grads_of(model)
            optimizer.step()
            optimizer.zero_grad()
    return fingerprint(accelerator.unwrap_model(model), losses, grads), guard and guard.last_snapshot


# ---- a Hugging Face Trainer subclass with its own compute_loss, under attach()
def bert_attach(folder, guarded, fault_step=None):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
    import nanreplay.transformers

    class Sentences(torch.utils.data.Dataset):
        def __len__(self):
            return 4 * K

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            label = -100 if fault_step is not None and i // 4 == fault_step else i % 2
            return {"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long), "labels": torch.tensor(label)}

    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            out = model(**inputs)
            loss = F.cross_entropy(out.logits, labels)  # LINE: bert loss
            return (loss, out) if return_outputs else loss

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            seen.append(float(loss))
            return loss

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            box["grads"] = grads_of(model)

    seen, box = [], {"grads": None}
    seed()
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=folder, max_steps=K, per_device_train_batch_size=4, learning_rate=1e-3,
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, train_sampling_strategy="sequential")
    trainer = MyTrainer(model=model, args=args, train_dataset=Sentences(), callbacks=[Grads()])
    cb = nanreplay.transformers.attach(trainer, folder) if guarded else None
    try:
        trainer.train()
    except Exception as e:
        if type(e).__name__ != "TrainingStopped":
            raise
    return fingerprint(model, seen, box["grads"]), cb and cb.guard.last_snapshot
'''

FAMILIES = ("cnn_step_fn", "mingpt", "lightning_cnn", "accelerate_cnn", "bert_attach")
NEEDS = {"lightning_cnn": "lightning", "accelerate_cnn": "accelerate", "bert_attach": "transformers"}


def _reset_accelerate():
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        return
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    for name in NEEDS.values():
        framework(name)
    root = tmp_path_factory.mktemp("invisible")
    mod = load_training_code(root / "proj", "invisiblemod", TRAINING_CODE)
    out = {}
    for fam in FAMILIES:
        fn = getattr(mod, fam)
        plain, _ = fn(str(root / fam / "off"), False)
        _reset_accelerate()
        guarded, healthy = fn(str(root / fam / "on"), True)
        _reset_accelerate()
        _, snap = fn(str(root / fam / "fault"), True, fault_step=1)
        _reset_accelerate()
        out[fam] = {"off": plain, "on": guarded, "healthy_snapshot": healthy, "snapshot": snap}
    paths = [out[f]["snapshot"] for f in FAMILIES]
    assert all(paths), {f: out[f]["snapshot"] for f in FAMILIES}
    analyses = analyze_isolated(paths, root / "elsewhere", also_blocked=("invisiblemod",))
    for fam in FAMILIES:
        out[fam]["analysis"] = analyses[out[fam]["snapshot"]]
    return out


def _same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        a, b = a.reshape(-1), b.reshape(-1)
        assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                           b.view(torch.uint8) if b.is_floating_point() else b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "shape"):  # numpy's generator state
        assert (a == b).all(), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("family", FAMILIES)
def test_guarded_run_is_bitwise_the_unguarded_one(runs, family):
    r = runs[family]
    assert len(r["off"]["losses"]) == 3 and r["off"]["grads"], r["off"]["losses"]
    assert r["healthy_snapshot"] in (None, False)
    _same(r["off"], r["on"], family)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fault_snapshot_analyzes_with_no_flags(runs, family):
    a = runs[family]["analysis"]
    d = torch.load(runs[family]["snapshot"], weights_only=True)
    assert d["step_program"] is not None, d.get("program_error")
    assert a["verdict"] == "culprit_found", a["verdict"]
