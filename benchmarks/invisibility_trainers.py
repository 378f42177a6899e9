"""The invisibility sweep's trainer modes (benchmarks/invisibility.py): the same K steps of an architecture under
Accelerate (`guard_for`), Lightning (`NanGuardCallback`) and a Hugging Face Trainer (`NanGuardCallback`; the
model's own loss), unguarded and guarded; each returns the run's fingerprint, as `invisibility.train` does."""

from __future__ import annotations

import struct

import torch

from nanreplay.replay.subject import call_model, compute_loss

TRAINER_MODES = ("accelerate", "lightning", "hf_callback", "hf_attach")


def _hex(loss: torch.Tensor) -> str:
    return struct.pack("<d", float(loss.detach().float())).hex()


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _fingerprint(model, losses, grads, opt, rng) -> dict:
    return {"losses": losses, "skipped": [], "grads": grads, "rng": rng(),
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "snapshots": [], "optimizer": opt.state_dict()["state"] if opt is not None else {}}


def train_accelerate(arch, guarded: bool, folder: str, *, k: int, seed, rng) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from nanreplay.accelerate import guard_for

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    seed()
    built = arch.make()
    loss_fn = built.loss_fn
    model, opt = accelerator.prepare(built.model, torch.optim.AdamW(built.model.parameters(), lr=1e-3))
    guard = guard_for(accelerator, model, opt, loss_fn=loss_fn, folder=folder) if guarded else None
    losses, grads = [], {}
    try:
        for step in range(k):
            inputs, target = built.batch(step)
            with accelerator.accumulate(model):
                if guard is not None:
                    guard.begin(inputs, target)
                loss = compute_loss(call_model(model, inputs), target, loss_fn)
                losses.append(_hex(loss))
                if guard is not None and not guard.loss_ok(loss):
                    raise RuntimeError("a healthy step was called non-finite")
                accelerator.backward(loss)
                if guard is not None and not guard.grads_ok():
                    raise RuntimeError("healthy gradients were called non-finite")
                grads = _grads(built.model)
                opt.step()
                opt.zero_grad()
    finally:
        if guard is not None:
            guard.close()
    return _fingerprint(built.model, losses, grads, opt, rng)


def train_lightning(arch, guarded: bool, folder: str, *, k: int, seed, rng) -> dict:
    import lightning.pytorch as L

    from nanreplay.lightning import NanGuardCallback

    class Module(L.LightningModule):
        def __init__(self, built):
            super().__init__()
            self.net, self.loss_fn = built.model, built.loss_fn
            self.losses, self.grads = [], {}

        def training_step(self, batch, batch_idx):
            inputs, target = batch
            loss = compute_loss(call_model(self.net, inputs), target, self.loss_fn)
            self.losses.append(_hex(loss))
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.grads = _grads(self.net)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    seed()
    built = arch.make()
    module = Module(built)
    loader = torch.utils.data.DataLoader([built.batch(step) for step in range(k)], batch_size=None)
    callbacks = [NanGuardCallback(folder)] if guarded else []
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, loader)
    return _fingerprint(built.model, module.losses, module.grads, trainer.optimizers[0], rng)


def train_hf(arch, guarded: bool, folder: str, *, k: int, seed, rng, attach: bool = False) -> dict:
    """`attach`: a Trainer subclass with its own compute_loss, guarded with `nanreplay.transformers.attach`."""
    if not arch.name.startswith("hf:"):
        raise ValueError("the Hugging Face Trainer mode is for transformers models")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import nanreplay.transformers
    from nanreplay.transformers import NanGuardCallback

    seed()
    built = arch.make()
    if built.loss_fn is not None:
        raise ValueError("the Trainer mode needs the model's own loss")
    batches = [built.batch(step)[0] for step in range(k)]
    seen, box = [], {"grads": {}}

    class Recorded(Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            seen.append(_hex(loss))
            return loss

        if attach:
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                out = model(**inputs)
                return (out.loss, out) if return_outputs else out.loss

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            box["grads"] = _grads(model)

    args = TrainingArguments(output_dir=folder, max_steps=k, per_device_train_batch_size=1, learning_rate=1e-3,
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, train_sampling_strategy="sequential")
    callbacks = [Grads()] + ([NanGuardCallback(folder)] if guarded and not attach else [])
    trainer = Recorded(model=built.model, args=args, train_dataset=batches, data_collator=lambda items: items[0],
                       callbacks=callbacks)
    if guarded and attach:
        nanreplay.transformers.attach(trainer, folder)
    trainer.train()
    return _fingerprint(built.model, seen, box["grads"], trainer.optimizer, rng)


def train_hf_attach(arch, guarded: bool, folder: str, *, k: int, seed, rng) -> dict:
    return train_hf(arch, guarded, folder, k=k, seed=seed, rng=rng, attach=True)


RUNNERS = {"accelerate": train_accelerate, "lightning": train_lightning, "hf_callback": train_hf,
           "hf_attach": train_hf_attach}
