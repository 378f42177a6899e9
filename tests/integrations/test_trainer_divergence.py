"""A real HF Trainer run with a typo'd learning rate (2e5 for 2e-5) and `max_grad_norm=1.0`: the callback
records the gradient norm *before* the Trainer clipped it (after clipping every step reads 1.0 and the climb is
invisible), the clip in force and the configured learning rate; the analysis — where neither transformers nor
the training code can be imported — calls it divergence and advises from that history: the typo, not "clip at
1" (the Trainer already does), not "lr/10" of a rate that should have been 1e10 times smaller."""

from __future__ import annotations

import subprocess
import sys

import pytest
from isolation import ROOT, analyze_isolated, framework

pytestmark = pytest.mark.integrations

TRAINING = r'''
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from nanreplay.errors import TrainingStopped
from nanreplay.transformers import NanGuardCallback

VOCAB = 64


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def lr_typo(folder):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=VOCAB,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=folder, max_steps=60, per_device_train_batch_size=2, learning_rate=2e5,
                             warmup_steps=30, max_grad_norm=1.0, report_to=[], save_strategy="no",
                             logging_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                             train_sampling_strategy="sequential")
    cb = NanGuardCallback(folder)
    try:
        Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
    except TrainingStopped:
        pass
    return cb.guard.last_snapshot


if __name__ == "__main__":
    print("lr_typo", lr_typo(sys.argv[1]))
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    framework("transformers")
    root = tmp_path_factory.mktemp("lrtypo")
    proj = root / "proj"
    proj.mkdir()
    (proj / "lrtypo.py").write_text(TRAINING)
    res = subprocess.run([sys.executable, "lrtypo.py", str(root / "snaps")], cwd=proj, capture_output=True,
                         text=True, timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                      "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    path = next(ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("lr_typo "))
    assert path.endswith(".pt"), res.stdout
    return analyze_isolated([path], root / "elsewhere", also_blocked=("lrtypo",))[path]


def test_the_history_holds_the_norm_before_the_trainer_clipped(run):
    rows = [r for r in run["snapshot_info"]["history"] if isinstance(r.get("grad_norm"), float)]
    assert rows and all(r["clip"] == 1.0 and r["base_lr"] == 2e5 for r in rows), rows[:3]
    assert max(r["grad_norm"] for r in rows) > 1e3  # clipped, every one would read <= 1.0
    assert rows[0]["grad_norm"] > 1.0 + 1e-3 or rows[1]["grad_norm"] > 1.0 + 1e-3


def test_divergence_advice_comes_from_the_run(run):
    diag = run["diagnosis"]
    assert diag["cause"] == "training_diverged", (diag["cause"], diag["title"])
    div = diag["divergence"]
    assert div["clip"] == 1.0 and div["base_lr"] == 2e5 and 0 < div["lr_at_onset"] < 2e5
    code = diag["fix"]["code"]
    assert "typo for 2e-05" in code and "learning_rate=2e-05" in code, code
    assert "clip_grad_norm_" not in code and "already clipped at max_norm=1" in code, code
    assert "typo" in diag["explanation"] and "clip gradients" not in diag["explanation"]


def test_the_typo_is_fixed_on_the_training_arguments_line_that_made_it(run):
    """The guard recorded where the rate was configured (capture/sites.py): the script's TrainingArguments call,
    whose learning_rate=2e5 is the optimizer's initial_lr; the fix is an edit of that literal and nothing else."""
    fix = run["diagnosis"]["fix"]
    (e,) = fix["edits"]
    assert e["file"].endswith("lrtypo.py") and e["line"] == TRAINING.splitlines().index(
        next(ln for ln in TRAINING.splitlines() if "args = TrainingArguments(" in ln)) + 1, e
    assert "learning_rate=2e5" in e["before"] and e["after"] == e["before"].replace("learning_rate=2e5",
                                                                                     "learning_rate=2e-05")
    assert fix["sites"][0]["what"] == "optimizer" and "learning_rate=200000" in fix["sites"][0]["evidence"]
