"""Divergence advice from the run's own history, not from constants: a climb is orders of magnitude above the
early steps whatever follows (a climb that then oscillates diverged all the same); the advice names the learning
rate where it began (configured and scheduled), a configured one that is a typo, and the clip already in force
(never "clip at 1" to a run that clips at 1). The real HF Trainer case: tests/integrations/test_trainer_divergence.py.
"""

from __future__ import annotations

import pytest

from nanreplay.diagnose.divergence import divergence, lr_clip_fix, remedy


def _info(losses, norms, lrs=None, clip=None, base=None):
    rows = []
    for i, (loss, norm) in enumerate(zip(losses, norms, strict=True)):
        r = {"step": i, "loss": loss, "grad_norm": norm}
        if lrs:
            r["lr"] = lrs[i]
        if clip is not None:
            r["clip"] = clip
        if base is not None:
            r["base_lr"] = base
        rows.append(r)
    rows.append({"step": len(rows), "loss": None, "grad_norm": None})
    return {"history": rows, "step": len(rows) - 1}


def test_a_climb_that_then_oscillates_is_divergence():
    losses = [0.69, 0.68, 0.7, 6.6e5, 12.0, 4e5, 30.0, 2e5, 9.0]  # climbed, then swings up and down
    norms = [1.0, 0.9, 1.1, 3e4, 20.0, 1e4, 50.0, 8e3, 30.0]
    d = divergence(_info(losses, norms))
    assert d is not None and d.onset == 3
    assert d.loss == ((1, 0.68), (3, 6.6e5)) and d.grad_norm[1] == (3, 3e4)  # the peak, not the last step


def test_a_healthy_noisy_run_is_not_divergence():
    losses = [2.3, 2.1, 2.4, 2.0, 2.2, 1.9, 2.1, 1.8]  # noise within a factor of two
    assert divergence(_info(losses, [1.0] * len(losses))) is None


def test_the_clip_in_force_is_not_advised_again():
    d = divergence(_info([0.7, 0.7, 0.7, 5e3, 8e3], [2.0, 2.5, 2.0, 9e4, 2e5], lrs=[1e-3] * 5, clip=1.0))
    assert d.clip == 1.0
    code = lr_clip_fix(d, {}).code
    assert "clip_grad_norm_" not in code and "already clipped at max_norm=1" in code and "2e+05" in code
    assert "the learning rate at 0.001" in code and "clipping is not the remedy" in remedy(d)


def test_a_configured_learning_rate_that_is_a_typo_is_named():
    lrs = [0.0, 6667.0, 13333.0, 20000.0, 26667.0]  # a warmup towards the configured 2e5
    d = divergence(_info([3.6, 3.6, 6e8, 2e9, 5e9], [2.6, 2.3, 6.7e4, 8.5e4, 1.9e5], lrs=lrs, clip=1.0, base=2e5))
    assert d.base_lr == 2e5 and d.lr_at_onset == pytest.approx(13333.0)
    code = lr_clip_fix(d, {}).code
    assert "typo for 2e-05" in code and "learning_rate=2e-05" in code and "clip_grad_norm_" not in code
    assert "typo" in remedy(d)


def test_the_scheduled_learning_rate_at_the_onset_is_said_against_the_configured_one():
    lrs = [1e-4, 2e-4, 3e-4, 4e-4, 5e-4]
    d = divergence(_info([2.0, 1.9, 1.8, 90.0, 400.0], [1.0, 1.1, 0.9, 300.0, 900.0], lrs=lrs, base=1e-3))
    code = lr_clip_fix(d, {}).code
    assert "the learning rate at 0.0004 (40% of the configured 0.001 on the schedule)" in code, code
    assert "max_norm=1" in code and "typo" not in code  # nothing clipped: clipping at the healthy norm is advised
