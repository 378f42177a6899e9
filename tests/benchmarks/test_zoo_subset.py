"""A fixed, diverse subset of the capture sweep and of the zoo (benchmarks/capture_sweep.py, benchmarks/zoo.py).

Sweep: each architecture — the world's model code built from a tiny config — trains one step under NanGuard;
the snapshot the guard writes is loaded back as `nanreplay analyze` loads it (no model code), its step program
replayed, and the loss and every parameter gradient must equal eager (bitwise, or within relative 1e-4).
Zoo: a few faults injected through a model's own code path must be localised: the culprit op is the injected
op, in the injected module, at the line a user would change, with the fault's cause.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import archs  # noqa: E402
import capture_sweep  # noqa: E402

pytest.importorskip("transformers")

pytestmark = pytest.mark.zoo

SUBSET = (
    # decoders
    "hf:llama", "hf:gpt2", "hf:gpt_neox", "hf:mistral", "hf:qwen2", "hf:phi3", "hf:gemma2", "hf:opt", "hf:falcon",
    # encoders
    "hf:bert", "hf:roberta", "hf:distilbert", "hf:electra", "hf:deberta-v2", "hf:modernbert",
    "hf:longformer",  # as_strided chunks, recorded as take
    # encoder-decoders
    "hf:bart", "hf:mt5", "hf:pegasus", "hf:m2m_100",
    # vision
    "hf:vit", "hf:deit", "hf:resnet", "hf:dinov2", "hf:mobilenet_v2",
    # audio (wav2vec2: weight-norm convolution, CTC, SpecAugment masks drawn from numpy)
    "hf:whisper", "hf:wav2vec2",
    # mixture of experts
    "hf:mixtral", "hf:qwen2_moe", "hf:jetmoe",
    # state-space / recurrent
    "hf:mamba", "hf:rwkv",
    # diffusion
    "diffusers:UNet2DModel", "diffusers:AutoencoderKL",
    # torch.nn stacks, a BatchNorm CNN, an LSTM language model
    "cnn:resnet", "rnn:lstm_lm", "nn:TransformerEncoderLayer", "nn:GRU", "loss:MultiMarginLoss",
)


@pytest.fixture(scope="module")
def by_name():
    return {a.name: a for a in archs.all_archs()}


@pytest.mark.parametrize("name", SUBSET)
def test_architecture_records_and_replays_equal_to_eager(name, by_name, tmp_path):
    if name.startswith("diffusers:"):
        pytest.importorskip("diffusers")
    row = capture_sweep.sweep_one(by_name[name], str(tmp_path))
    assert row.status == "recorded", f"{name}: {row.status}: {row.op or row.reason}"
    assert row.nodes >= 3 and row.max_diff is not None and row.max_diff <= capture_sweep.RTOL


def test_the_subset_is_diverse(by_name):
    families = {by_name[n].family for n in SUBSET}
    assert len(SUBSET) >= 30
    assert {"decoder", "encoder", "encoder-decoder", "vision", "audio", "moe", "state-space", "diffusion"} <= families


ZOO_FAULTS = (  # (architecture, fault kind, precision)
    ("cnn:resnet", "masked_row", "fp32"),
    ("hf:llama", "sqrt_zero", "fp32"),
    ("hf:llama", "rsqrt_zero", "fp32"),
    ("nn:LSTM", "div_zero", "fp32"),
    ("hf:vit", "fp16_overflow", "fp16"),
    ("loss:MSELoss", "nan_sample", "fp32"),
)


@pytest.mark.parametrize("arch,kind,precision", ZOO_FAULTS)
def test_injected_fault_is_localised(arch, kind, precision, by_name, tmp_path):
    import zoo
    import zoo_faults

    r = zoo.run_one(by_name[arch], zoo_faults.KINDS[kind], precision, 0, str(tmp_path))
    assert r.status == "scored", f"{arch} {kind}: {r.status}: {r.reason}"
    s = r.scores
    assert s["snapshot"], f"trigger {r.trigger}"
    assert s["op"], f"culprit {r.culprit_op}, injected {sorted(zoo_faults.KINDS[kind].ops)}"
    assert s["module"], f"culprit module {r.culprit_module!r}, injected {r.site!r}"
    if "line" in s:
        assert s["line"], f"line {r.culprit_line}, the user's line is zoo_faults.py:{zoo_faults.site_line(kind)}"
    assert s["cause"], f"cause {r.cause}"
