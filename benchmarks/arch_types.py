"""What the zoo's architecture lists hold: an `Arch` (name, family, how to make it) and what it makes (`Built`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn


@dataclass
class Built:
    """One architecture, ready to train: `model(inputs)` then `loss_fn(output, target)` (None: the model's own)."""

    model: nn.Module
    batch: Callable[[int], tuple[Any, Any]]  # step -> (inputs, target), deterministic per step
    loss_fn: Callable | None = None


@dataclass
class Arch:
    name: str  # "hf:llama" / "nn:LSTM" / "cnn:resnet" / "diffusers:UNet2DModel"
    family: str  # decoder, encoder, encoder-decoder, vision, audio, moe, state-space, diffusion, torch.nn, cnn, rnn
    make: Callable[[], Built]
    head: str = ""


class Skipped(Exception):
    """This architecture cannot be built or trained here; the message says why."""
