"""Probes and verifications run on independent copies: the step being analyzed never changes.

The float64 precision probe used to turn the model it probed into float64 (the copy shared its
parameters), so the verdict said "finite in float32, float64 but not in float64". Every replay but
the analysis' own now runs on `Subject.converted`, which copies everything.
"""

from __future__ import annotations

import pytest
import torch

import causes
import nanmodels
import samples
from nanreplay import analysis, formats, replay, verify
from nanreplay.replay.subject import batch_tensors


def _state(subject) -> dict:
    m = subject.model
    return {"params": {n: (p.dtype, p.detach().clone(), id(p)) for n, p in m.named_parameters()},
            "buffers": {n: (b.dtype, b.detach().clone()) for n, b in m.named_buffers()},
            "batch": {n: (t.dtype, t.detach().clone()) for n, _, t in batch_tensors(subject)}}


def _assert_same(subject, before: dict) -> None:
    now = _state(subject)
    assert now["params"].keys() == before["params"].keys()
    for n, (dtype, value, ident) in before["params"].items():
        d2, v2, i2 = now["params"][n]
        assert (d2, i2) == (dtype, ident) and torch.equal(v2, value), n
    for part in ("buffers", "batch"):
        assert now[part].keys() == before[part].keys()
        for n, (dtype, value) in before[part].items():
            assert now[part][n][0] == dtype and torch.equal(now[part][n][1], value), (part, n)


def _subject(tmp_path, module, name):
    c = module.CASES[name]
    path = c.save(tmp_path / f"{name}_step_3.pt")
    return formats.rebuild(formats.load(path), model=c.model_spec, loss=c.loss, device=None, trust=False)


def _no_shared_storage(a, b) -> bool:
    ptrs = {t.untyped_storage().data_ptr() for t in list(a.parameters()) + list(a.buffers()) if t.numel()}
    return not any(t.untyped_storage().data_ptr() in ptrs for t in list(b.parameters()) + list(b.buffers())
                   if t.numel())


EAGER = [(causes, "stateful_log_zero"), (nanmodels, "fp16"), (nanmodels, "masked_row"), (causes, "autocast_fp16")]


@pytest.mark.parametrize("module,name", EAGER, ids=[n for _, n in EAGER])
@pytest.mark.parametrize("dtype", [None, torch.float64, torch.bfloat16])
def test_converted_is_an_independent_copy(tmp_path, module, name, dtype):
    """Subject.converted: a new model that shares no parameter or buffer with the original; converting,
    replaying and writing into the copy leave the original's values and dtypes as they were."""
    subject = _subject(tmp_path, module, name)
    before = _state(subject)
    copy = subject.converted(dtype)
    assert copy.model is not subject.model and _no_shared_storage(subject.model, copy.model)
    with torch.no_grad():
        for p in copy.model.parameters():
            p.add_(1.0)
    _assert_same(subject, before)


@pytest.mark.parametrize("name", samples.names())
def test_independent_copies_of_every_sample(name):
    """Subject.converted, what every probe and verification replays on, for the native samples too (a
    program model whose own copies shared its weights): float64 probes leave the step in its dtype."""
    snap = formats.load(samples.SAMPLES / f"{name}.pt")
    subject = formats.rebuild(snap, device=None, trust=False, **{"model": None, "loss": None, **samples.flags(name)})
    before = _state(subject)
    for dtype in (None, torch.float64):
        copy = subject.converted(dtype)
        assert _no_shared_storage(subject.model, copy.model)
        assert not any(t is u for _, _, t in batch_tensors(copy) for _, _, u in batch_tensors(subject))
        verify.plain_step(copy)
    _assert_same(subject, before)


@pytest.mark.parametrize("module,name", [(causes, "stateful_log_zero"), (nanmodels, "fp16")], ids=["bn", "fp16"])
def test_analysis_leaves_the_analyzed_step_untouched(tmp_path, monkeypatch, module, name):
    """After the analysis' own replay, nothing else it runs — fix verifications, the precision probe (float64,
    bfloat16), the plausibility reference, provenance — changes the model's parameters, buffers (BatchNorm's
    running stats), dtypes or the batch (which the model writes into)."""
    seen: dict = {"copies": 0}
    rebuild, run = formats.rebuild, replay.run_subject

    def spy_rebuild(*a, **k):
        seen["subject"] = rebuild(*a, **k)
        return seen["subject"]

    def spy_run(subject, **k):
        step = run(subject, **k)
        if subject is seen["subject"]:
            seen.setdefault("after_own_replay", _state(subject))
        else:
            seen["copies"] += 1
        return step

    patched = replay.run_patched

    def spy_patched(subject, *a, **k):  # a fix that verifies replays uninstrumented
        assert subject is not seen["subject"]
        seen["copies"] += 1
        return patched(subject, *a, **k)

    monkeypatch.setattr(formats, "rebuild", spy_rebuild)
    monkeypatch.setattr(replay, "run_subject", spy_run)
    monkeypatch.setattr(replay, "run_patched", spy_patched)
    c = module.CASES[name]
    d = analysis.analyze(c.save(tmp_path / f"{name}_step_3.pt"), model=c.model_spec, loss=c.loss).to_json()
    assert d["verdict"] == "culprit_found" and seen["copies"] >= 1 and d["precision"]
    _assert_same(seen["subject"], seen["after_own_replay"])
    dtype = "float16" if name == "fp16" else "float32"
    assert d["model"]["dtypes"] == [dtype]
    assert f"but not in {dtype}" in d["diagnosis"]["precision"] or "too" in d["diagnosis"]["precision"]
