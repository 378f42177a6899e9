"""The shipped sample snapshots (`sample_snapshots/*.pt`): where they are, what each must give, how to analyze one.

Shared by the sample tests, the report tests and the golden JSON test.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_snapshots"

# native sample -> (culprit op, phase, cause); they need no flags: model and loss travel inside
EXPECTED = {
    "sqrt_zero": ("aten.div.Tensor", "backward", "sqrt_at_zero"),
    "log_zero": ("aten.log.default", "forward", "log_of_zero"),
    "sqrt_negative": ("aten.sqrt.default", "forward", "sqrt_of_negative"),
    "zero_norm": ("aten.div.Tensor", "forward", "normalize_zero_norm"),
    "zero_log_zero": ("aten.log.default", "forward", "zero_times_log_zero"),
    "log_softmax": ("aten.div.Tensor", "backward", "log_softmax"),
    "fp16_overflow": ("aten.addmm.default", "forward", "magnitude_overflow"),  # fc2's weights grew: any dtype
}
STATE_DICT_SAMPLE = "nan_snapshot_step_3"  # a plain state-dict snapshot: it needs --model
FLAGS = {STATE_DICT_SAMPLE: {"model": "sample_snapshots.models:triplet"}}


def names() -> list[str]:
    """Every shipped sample, by file stem."""
    return sorted(p.stem for p in SAMPLES.glob("*.pt"))


def flags(name: str) -> dict:
    """The `analyze()` arguments a sample needs (what its user would pass on the command line)."""
    return dict(FLAGS.get(name, {}))
