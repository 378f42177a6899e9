"""The invisibility sweep's CI subset (benchmarks/invisibility.py): real architectures, built fresh from one seed,
train 3 steps unguarded and guarded in each mode a loop uses the guard in (loss_fn or the model's own loss,
step_fn, two micro-batches, a CPU GradScaler, a NaN step the loop skips); every loss, weight, buffer, gradient,
optimizer state and RNG stream must be bitwise equal, and the guarded run must not raise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import archs  # noqa: E402
import invisibility  # noqa: E402

pytest.importorskip("transformers")

pytestmark = pytest.mark.zoo

SUBSET = (  # BatchNorm (buffers written in place), dropout (RNG), recurrent, attention, decoders/encoders/vision
    "cnn:resnet", "nn:BatchNorm1d", "nn:TransformerEncoderLayer", "nn:LSTM", "nn:RReLU", "nn:AlphaDropout",
    "rnn:gru_lm", "loss:TripletMarginLoss", "hf:llama", "hf:bert", "hf:vit", "hf:resnet",
)
MODES = ("loss", "step_fn", "micro", "skip")
SCALER = ("cnn:resnet", "nn:TransformerEncoderLayer", "hf:llama")


@pytest.fixture(scope="module")
def by_name():
    return {a.name: a for a in archs.all_archs()}


@pytest.mark.parametrize("name", SUBSET)
def test_guarded_runs_are_the_unguarded_runs_bitwise(name, by_name, tmp_path):
    modes = MODES + (("scaler",) if name in SCALER else ())
    rows = invisibility.sweep_arch(by_name[name], modes, str(tmp_path))
    assert len(rows) == len(modes)
    for row in rows:
        assert row.status == "identical", f"{name} [{row.mode}] {row.status}: {row.differences[:5]}"


def test_the_subset_is_big_enough():
    assert len(SUBSET) * len(MODES) + len(SCALER) >= 40
