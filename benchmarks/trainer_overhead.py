"""The trainer integrations' cost on healthy steps: the same run with and without the one line.

    python benchmarks/trainer_overhead.py [--rounds 3] [--steps 12] [--only lightning,transformers,accelerate]

Each framework trains a small transformer on CPU: Lightning a LightningModule around the benchmarks'
transformer (2 layers, d=256, seq 128, batch 8), the Hugging Face Trainer a randomly initialised GPT-2 of
the same size, Accelerate the transformer in docs/integrations.md's loop. A run is `--steps` optimizer steps; the
step time is the median time between consecutive step starts after two warm-up steps (so start-up, which
the guard does not change, is left out). Runs with and without the guard alternate for `--rounds` rounds;
the ratio printed is guarded / plain per round, and their median. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import transformer as tf  # noqa: E402

LAYERS, D, HEADS, SEQ, BATCH = 2, 256, 4, 128, 8
WARMUP = 2
# CPU time of this process, not wall time: on a shared machine other processes' load would swamp a few percent
# (with --threads 1 there is no spinning pool thread to inflate it either); --wall for wall-clock time
CLOCK = time.process_time


def step_time(starts: list[float]) -> float:
    gaps = [b - a for a, b in zip(starts[WARMUP:], starts[WARMUP + 1:], strict=False)]
    return statistics.median(gaps)


def tokens(n: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (n, SEQ), generator=g)


# ------------------------------------------------------------------ Lightning


def lightning_run(steps: int, folder: str | None) -> float:
    import lightning.pytorch as L

    from nanreplay.lightning import NanGuardCallback

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tf.Transformer(layers=LAYERS, d=D, heads=HEADS)

        def training_step(self, batch, batch_idx):
            (idx,) = batch
            loss = tf.loss_fn(self.net(idx[:, :-1]), idx[:, 1:])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    starts: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            starts.append(CLOCK())

    torch.manual_seed(0)
    callbacks = [Clock()] + ([NanGuardCallback(folder)] if folder else [])
    data = torch.utils.data.TensorDataset(tokens(BATCH * (steps + 1), tf.VOCAB))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                        callbacks=callbacks)
    trainer.fit(LM(), torch.utils.data.DataLoader(data, batch_size=BATCH))
    return step_time(starts)


# ------------------------------------------------------------------ Hugging Face Trainer


def transformers_run(steps: int, folder: str | None) -> float:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from nanreplay.transformers import NanGuardCallback

    starts: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            starts.append(CLOCK())

    class Rows(torch.utils.data.Dataset):
        def __init__(self, ids):
            self.ids = ids

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    config = GPT2Config(n_layer=LAYERS, n_embd=D, n_head=HEADS, n_positions=SEQ, vocab_size=tf.VOCAB, bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM")
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=1e-4,
                                 report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
                                 dataloader_num_workers=0, disable_tqdm=True)
        callbacks = [Clock()] + ([NanGuardCallback(folder)] if folder else [])
        trainer = Trainer(model=GPT2LMHeadModel(config), args=args, callbacks=callbacks,
                          train_dataset=Rows(tokens(BATCH * (steps + 1), tf.VOCAB)))
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its metrics
            trainer.train()
    _reset_accelerate()
    return step_time(starts)


# ------------------------------------------------------------------ Accelerate


def accelerate_run(steps: int, folder: str | None) -> float:
    from accelerate import Accelerator

    from nanreplay.accelerate import guard_for

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = tf.Transformer(layers=LAYERS, d=D, heads=HEADS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens(BATCH * (steps + 1), tf.VOCAB)),
                                         batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    guard = guard_for(accelerator, model, optimizer, loss_fn=tf.loss_fn, folder=folder) if folder else None
    starts: list[float] = []
    for (idx,) in loader:
        if len(starts) == steps:
            break
        starts.append(CLOCK())
        x, y = idx[:, :-1], idx[:, 1:]
        if guard is not None:
            guard.begin(x, y)
        loss = tf.loss_fn(model(x), y)
        if guard is not None and not guard.loss_ok(loss):
            raise SystemExit("unexpected non-finite loss")
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        if guard is not None and not guard.grads_ok(norm):
            raise SystemExit("unexpected non-finite gradient")
        optimizer.step()
        optimizer.zero_grad()
    _reset_accelerate()
    return step_time(starts)


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


RUNS = {"lightning": lightning_run, "transformers": transformers_run, "accelerate": accelerate_run}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true", help="time steps by the wall clock instead of CPU time")
    ap.add_argument("--only", default=",".join(RUNS))
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.wall else time.process_time
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.only.split(","):
            run = RUNS[name]
            run(WARMUP + 2, None)  # imports and first-time set-up, outside the timed rounds
            ratios, plain_times = [], []
            for r in range(args.rounds):
                order = (None, folder) if r % 2 == 0 else (folder, None)
                t = {bool(f): run(args.steps, f) for f in order}
                ratios.append(t[True] / t[False])
                plain_times.append(t[False])
            print(f"{name:13s} step {statistics.median(plain_times) * 1e3:7.1f} ms   guarded/plain per round "
                  f"{' '.join(f'{x:.3f}' for x in ratios)}   median {statistics.median(ratios):.3f}x")
        assert not list(Path(folder).iterdir()), "a healthy run must not write snapshots"


if __name__ == "__main__":
    main()
