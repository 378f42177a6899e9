"""nanreplay.transformers in real Hugging Face Trainer runs of a randomly initialised tiny GPT-2 (CPU, no
downloads, seconds each).

A fully label-masked batch makes the model's own loss 0/0 (`num_items_in_batch` is 0): the callback, the
one line a user adds, stops training before backward, in fp32 and under bf16. A custom `compute_loss_func`
(a per-micro-batch mean) with a masked micro-batch in the middle of an accumulation window needs `attach()`:
without it the callback says so, with it the snapshot is that micro-batch. A sqrt at zero in a plain module
the Trainer trains gives a finite loss and an Inf gradient: training stops before the optimizer steps, with
the micro-batch that broke. Each snapshot is analyzed where
neither transformers, accelerate, Lightning nor the training code can be imported. A healthy run records the
model's own losses and writes nothing; `skip` goes on without applying the bad step.
"""

from __future__ import annotations

import logging

import pytest
import torch
from isolation import analyze_isolated, framework, load_training_code, marker_line

pytestmark = pytest.mark.integrations

TRAINING_CODE = '''
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB = 64


def tiny_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=VOCAB, bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Random token rows; the rows in `masked` have every label set to -100 (say, a prompt-only sample)."""

    def __init__(self, n=64, masked=()):
        self.n, self.masked = n, set(masked)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(i))
        labels = torch.full_like(ids, -100) if i in self.masked else ids.clone()
        return {"input_ids": ids, "labels": labels}


def mean_ce(outputs, labels, num_items_in_batch=None):
    """A per-micro-batch mean: ignores num_items_in_batch, so a micro-batch with no labels is 0/0."""
    logits = outputs.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))  # LINE: mean ce


class PairModel(torch.nn.Module):
    """Not every model a Trainer trains is a transformer: embedding distances, a duplicated pair is sqrt at
    zero (a finite loss, an Inf gradient)."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))

    def forward(self, a, b, labels=None):
        d = ((self.enc(a) - self.enc(b)) ** 2).sum(-1).sqrt()  # LINE: sqrt
        return {"loss": F.mse_loss(d, labels), "distance": d}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n=32, duplicate=None):
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, 6, generator=g)
        self.b = self.a + 0.3 * torch.randn(n, 6, generator=g)
        if duplicate is not None:
            self.b[duplicate] = self.a[duplicate]

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        return {"a": self.a[i], "b": self.b[i], "labels": torch.tensor(0.5)}


def trainer(folder, dataset, steps=4, accumulate=1, callbacks=(), model=None, **kwargs):
    args = TrainingArguments(output_dir=str(folder), max_steps=steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulate, learning_rate=1e-3, report_to=[],
                             save_strategy="no", logging_strategy="no", use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True, train_sampling_strategy="sequential", bf16=kwargs.pop("bf16", False))
    return Trainer(model=model or tiny_gpt2(), args=args, train_dataset=dataset, callbacks=list(callbacks), **kwargs)
'''


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    framework("transformers")
    return load_training_code(tmp_path_factory.mktemp("proj"), "hfmod", TRAINING_CODE)


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Each Trainer sets up accelerate's process-wide state; bf16 and fp32 runs must not share it."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def stopped_run(trainer):
    from nanreplay.errors import TrainingStopped

    with pytest.raises(TrainingStopped) as info:
        trainer.train()
    path = info.value.snapshot
    assert path and f"nanreplay analyze {path}" in str(info.value)
    return path


@pytest.fixture(scope="module")
def runs(mod, tmp_path_factory):
    from nanreplay.transformers import NanGuardCallback, attach

    out = tmp_path_factory.mktemp("snaps")
    cases = {}
    # rows 4 and 5 make up batch 2: its loss is sum / num_items_in_batch = 0 / 0
    for name, bf16 in (("masked", False), ("masked_bf16", True)):
        cb = NanGuardCallback(out / name)
        t = mod.trainer(out / "run", mod.Tokens(masked={4, 5}), callbacks=[cb], bf16=bf16)
        cases[name] = stopped_run(t)
        _reset()
    # rows 6 and 7 are batch 3: a finite loss, an Inf gradient; 2 micro-batches per step: step 1, micro-batch 1
    t = mod.trainer(out / "run", mod.Pairs(duplicate=7), accumulate=2, model=mod.PairModel(),
                    callbacks=[NanGuardCallback(out / "gradient")])
    cases["gradient"] = stopped_run(t)
    assert all(torch.isfinite(p).all() for p in t.model.parameters()), "the NaN update was applied"
    _reset()
    # 4 micro-batches of 2 rows per step: rows 12, 13 are step 1's micro-batch 2
    t = mod.trainer(out / "run", mod.Tokens(masked={12, 13}), accumulate=4, compute_loss_func=mod.mean_ce)
    attach(t, out / "attached")
    cases["attached"] = stopped_run(t)
    _reset()
    analyses = analyze_isolated(list(cases.values()), tmp_path_factory.mktemp("elsewhere"), also_blocked=("hfmod",))
    return {k: (p, analyses[p]) for k, p in cases.items()}


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("case", ["masked", "masked_bf16"])
def test_a_fully_masked_batch_is_zero_over_zero_in_the_model_loss(runs, case):
    path, d = runs[case]
    snap = torch.load(path, weights_only=True)
    assert snap["trigger"] == "loss" and snap["step"] == 2 and snap["micro_batch"] is None
    inputs = snap["batch"]["inputs"]
    assert set(inputs) >= {"input_ids", "labels", "num_items_in_batch"}
    assert bool((inputs["labels"] == -100).all()) and float(inputs["num_items_in_batch"]) == 0.0
    assert snap["loss_spec"]["kind"] != "step_fn"  # the model's own loss, inside its ModelOutput
    assert "step program" in d["model"]["how"], d["model"]["how"]
    assert d["verdict"] == "culprit_found" and d["culprit"]["op"].startswith("aten.div")
    src = d["culprit"]["source"]
    assert src["file"].endswith("transformers/loss/loss_utils.py") and src["code"].strip() == \
        "loss = loss / num_items_in_batch"
    assert d["diagnosis"]["cause"] == "empty_reduction"  # a count of 0 (num_items_in_batch), not a generic 0/0


def test_bf16_is_recorded_as_autocast(runs):
    snap = torch.load(runs["masked_bf16"][0], weights_only=True)
    assert snap["autocast"] == {"device_type": "cpu", "dtype": "bfloat16", "enabled": True}


def test_attach_records_compute_loss_func_and_the_micro_batch_that_broke(runs):
    path, d = runs["attached"]
    snap = torch.load(path, weights_only=True)
    assert (snap["trigger"], snap["step"], snap["micro_batch"]) == ("loss", 1, 2), path
    assert bool((snap["batch"]["batch"]["inputs"]["labels"] == -100).all())
    assert d["verdict"] == "culprit_found"
    src = d["culprit"]["source"]
    assert (src["file"].rsplit("/", 1)[-1], src["line"]) == ("hfmod.py", marker_line(TRAINING_CODE, "mean ce"))
    assert d["diagnosis"]["cause"] == "empty_reduction"


def test_a_nan_gradient_stops_training_before_the_optimizer_applies_it(runs):
    path, d = runs["gradient"]
    snap = torch.load(path, weights_only=True)
    assert (snap["trigger"], snap["step"], snap["micro_batch"]) == ("gradient", 1, 1), path
    assert d["verdict"] == "culprit_found" and d["diagnosis"]["cause"] == "sqrt_at_zero"
    src = d["culprit"]["source"]
    assert (src["file"].rsplit("/", 1)[-1], src["line"]) == ("hfmod.py", marker_line(TRAINING_CODE, "sqrt"))


def test_without_attach_the_callback_says_it_is_needed(mod, tmp_path, caplog):
    from nanreplay.transformers import NanGuardCallback

    caplog.set_level(logging.WARNING, logger="nanreplay")
    t = mod.trainer(tmp_path / "run", mod.Tokens(), steps=2, compute_loss_func=mod.mean_ce,
                    callbacks=[NanGuardCallback(tmp_path / "snaps")])
    t.train()
    said = [r.getMessage() for r in caplog.records if "attach(trainer)" in r.getMessage()]
    assert len(said) == 1 and "compute_loss_func" in said[0]


def test_a_healthy_run_records_the_model_losses_and_writes_nothing(mod, tmp_path):
    from nanreplay.transformers import NanGuardCallback

    cb = NanGuardCallback(tmp_path / "snaps")
    t = mod.trainer(tmp_path / "run", mod.Tokens(), steps=3, accumulate=2, callbacks=[cb])
    losses = []
    t.model.register_forward_hook(lambda m, a, out: losses.append(float(out.loss.detach())) if m.training else None)
    t.train()
    assert not (tmp_path / "snaps").exists() and cb.guard.snapshots == []
    rows = [h for h in cb.guard.history if h["loss"] is not None]
    assert [h["step"] for h in rows] == [0, 1, 2]
    assert [h["loss"] for h in rows] == pytest.approx([losses[i] + losses[i + 1] for i in (0, 2, 4)], rel=1e-5)
    assert all(h["grad_norm"] is not None and h["grad_norm"] > 0 for h in rows)


def test_skip_goes_on_without_applying_the_bad_step(mod, tmp_path):
    from transformers import TrainerCallback

    from nanreplay.transformers import NanGuardCallback

    cb = NanGuardCallback(tmp_path / "snaps", on_nonfinite="skip")
    t = mod.trainer(tmp_path / "run", mod.Tokens(masked={4, 5}), steps=4, callbacks=[cb])
    weights = {}

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            weights[state.global_step] = [p.detach().clone() for p in model.parameters()]

    t.add_callback(Watch())
    t.train()
    assert t.state.global_step == 4 and len(cb.guard.snapshots) == 1 and "nan_step000002_loss" in cb.guard.snapshots[0]
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    assert all(torch.equal(x, y) for x, y in zip(weights[2], weights[3], strict=True)), "the bad step changed the weights"
    assert not all(torch.equal(x, y) for x, y in zip(weights[1], weights[2], strict=True))
