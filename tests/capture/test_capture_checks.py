"""The pieces behind "every snapshot the guard writes analyzes with no flags", each on its own:

* `capture/plain.py`: what training code leaves in optimizer/scheduler state and batches becomes plain data;
* the first step's loss check: silent where the guard's loss is the loop's (also under gradient
  accumulation's `/ N`), one warning naming the fix where it is not, the loop's own loss found by value;
* weight norm (both APIs) and CTC record and replay bit for bit; a program whose CTC labels or weight-norm
  gains address outside their tensors is refused before any kernel runs;
* the fallback recipe: a class and the constructor arguments it keeps (a transformers config as JSON), or
  no factory and the reason; `--trust` really rebuilds a Wav2Vec2ForCTC no program was recorded for.
"""

from __future__ import annotations

import dataclasses
import decimal
import enum
import fractions
import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.capture import plain
from nanreplay.capture.program import record_step
from nanreplay.capture.recipe import recipe
from nanreplay.errors import SnapshotError
from nanreplay.formats.dryrun import dry_run
from nanreplay.formats.program import DTYPES, decode, to_json
from nanreplay.formats.stepmodel import StepModule
from nanreplay.formats.usercode import build_model


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


@dataclasses.dataclass
class Hyper:
    lr: float
    name: str


def test_plain_data_turns_what_training_code_keeps_into_json_values_and_tensors():
    np = pytest.importorskip("numpy")
    got = plain.data({"lr": np.float64(0.5), "n": np.int64(3), "ok": np.bool_(True), "s": np.str_("x"),
                      "arr": np.arange(3, dtype=np.float32), "obj": np.array([1, "a"], dtype=object),
                      "frac": fractions.Fraction(1, 4), "dec": decimal.Decimal("0.125"), "color": Color.RED,
                      "level": Level.HIGH, "hyper": Hyper(np.float64(1e-3), "adam"), "betas": (0.9, np.float64(0.99)),
                      "dtype": torch.float16, "dev": torch.device("cpu"), np.int64(7): "int key", (1, 2): "tuple key",
                      "thing": object()})
    assert type(got["lr"]) is float and type(got["n"]) is int and got["ok"] is True and type(got["s"]) is str
    assert torch.equal(got["arr"], torch.tensor([0.0, 1.0, 2.0])) and got["obj"] == [1, "a"]
    assert got["frac"] == 0.25 and got["dec"] == 0.125 and got["color"] == "red" and type(got["level"]) is int
    assert got["hyper"] == {"lr": 1e-3, "name": "adam"} and type(got["hyper"]["lr"]) is float
    assert got["betas"] == [0.9, 0.99] and got["dtype"] == "float16" and got["dev"] == "cpu"
    assert got[7] == "int key" and got["(1, 2)"] == "tuple key" and got["thing"].startswith("<object object")
    assert plain.data((1, (2,)), keep_tuples=True) == (1, (2,))
    with pytest.raises(plain.NotData):
        plain.data([object()], unknown=plain.refuse)


def _loop(guard, model, steps, make_loss, accumulate=1, whole_batch=False):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = torch.Generator().manual_seed(0)
        for step in range(steps):
            for k in range(accumulate):
                x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
                if whole_batch:  # step_fn: begin(batch)
                    guard.begin((x, y), step=step)
                else:
                    guard.begin(x, y, step=step, micro_batch=k if accumulate > 1 else None)
                loss = make_loss(model, x, y) / accumulate
                assert guard.loss_ok(loss)
                loss.backward()
            assert guard.grads_ok()
    return [str(w.message) for w in caught if "nanreplay" in str(w.message)]


def test_a_loss_fn_that_is_the_loop_s_loss_is_silent_also_under_accumulation(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    guard = NanGuard(model, None, loss_fn=F.cross_entropy, folder=tmp_path)
    assert _loop(guard, model, 3, lambda m, x, y: F.cross_entropy(m(x), y), accumulate=4) == []
    assert guard._record_loss is F.cross_entropy


def test_a_loss_the_model_does_not_return_warns_once_that_snapshots_record_loss_fn(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    guard = NanGuard(model, None, loss_fn=F.cross_entropy, folder=tmp_path)
    said = _loop(guard, model, 3, lambda m, x, y: F.cross_entropy(m(x), y) + 0.5 * m.weight.square().sum())
    assert len(said) == 1 and "none of the model's outputs" in said[0] and "step_fn=" in said[0], said


class DictLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y=None):
        logits = self.fc(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, y)}


def test_the_loop_s_loss_is_found_among_the_outputs_by_value(tmp_path):
    torch.manual_seed(0)
    model = DictLoss()
    guard = NanGuard(model, None, loss_fn=F.mse_loss, folder=tmp_path)  # wrong: the model has its own loss
    said = _loop(guard, model, 2, lambda m, x, y: m(x, y)["loss"] * 1.0)  # a copy: found by value, not identity
    assert len(said) == 1 and "pass loss_fn=None" in said[0] and "output['loss']" in said[0], said
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    x[0, 0] = float("nan")
    guard.begin(x, y, step=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not guard.loss_ok(model(x, y)["loss"])
    d = torch.load(guard.last_snapshot, weights_only=True)
    assert d["step_program"] is not None and d["loss_spec"] == {"kind": "output"}
    assert len(d["batch"]["inputs"]) == 2  # model(x, y), the call the loop made (begin() was given x)


def test_a_step_fn_is_run_once_from_the_step_s_state_and_checked(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5))  # dropout: the rerun must see the same mask

    def step_fn(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1])

    guard = NanGuard(model, None, step_fn=step_fn, folder=tmp_path)
    assert _loop(guard, model, 2, lambda m, x, y: step_fn(m, (x, y)), whole_batch=True) == []
    guard = NanGuard(model, None, step_fn=step_fn, folder=tmp_path)
    said = _loop(guard, model, 2, lambda m, x, y: 2 * step_fn(m, (x, y)) + 1, whole_batch=True)
    assert len(said) == 1 and "step_fn=step_fn(model, batch) gives" in said[0], said
    guard = NanGuard(model, None, step_fn=step_fn, folder=tmp_path)
    said = _loop(guard, model, 2, lambda m, x, y: step_fn(m, (x, y)))  # begin(x, y): the batch lacks y
    assert len(said) == 1 and "raises" in said[0], said


class OldWeightNorm(nn.Module):
    def __init__(self, classes=6):
        super().__init__()
        self.conv = nn.utils.weight_norm(nn.Conv1d(2, 8, 5, padding=2), dim=0)  # the old API
        self.pos = nn.utils.parametrizations.weight_norm(nn.Conv1d(8, 8, 3, padding=1, groups=2), dim=2)
        self.head = nn.Linear(8, classes)

    def forward(self, audio):
        h = F.gelu(self.conv(audio))
        h = h + self.pos(h)
        return self.head(h.transpose(1, 2)).log_softmax(-1).transpose(0, 1)  # (T, N, C) for CTC


def _ctc_step(targets_2d: bool):
    torch.manual_seed(0)
    model = OldWeightNorm()
    audio = torch.randn(3, 2, 20)
    lengths = torch.tensor([20, 17, 12])
    target_lengths = torch.tensor([4, 2, 3])
    targets = torch.randint(1, 6, (3, 4)) if targets_2d else torch.randint(1, 6, (int(target_lengths.sum()),))

    def loss(out):
        return F.ctc_loss(out, targets, lengths, target_lengths, blank=0)

    rec = record_step(lambda: model(audio), loss, model=model, batch={"inputs": audio, "target": None})
    eager = loss(model(audio))
    eager.backward()
    return model, rec, eager, targets, audio


@pytest.mark.parametrize("targets_2d", [True, False])
def test_weight_norm_and_ctc_replay_bit_for_bit(targets_2d):
    model, rec, eager, _, audio = _ctc_step(targets_2d)
    prog = decode(to_json(rec.program))
    ops = {n.name for n in prog.nodes}
    assert "aten._weight_norm_interface.default" in ops and any(o.startswith("aten._ctc_loss") for o in ops)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = [n for n, _ in model.named_parameters()]
    step = StepModule(prog, state, params, {}, rec.constants)
    replayed = step(audio, None)
    replayed.backward()
    assert torch.equal(replayed.detach(), eager.detach())
    grads = dict(model.named_parameters())
    assert all(torch.equal(p.grad, grads[n].grad) for n, p in step.named_parameters()), "gradients differ"


def test_ctc_labels_outside_the_classes_are_refused_before_the_kernel():
    model, rec, _, targets, audio = _ctc_step(True)
    prog = decode(to_json(rec.program))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    name = next(k for k, v in rec.constants.items() if v.shape == targets.shape and torch.equal(v, targets))
    constants = dict(rec.constants)
    constants[name] = targets.clone()
    constants[name][1, 0] = 10**6  # a label far past the 6 classes: the kernel would read outside log_probs
    step = StepModule(prog, state, [n for n, _ in model.named_parameters()], {}, constants)
    with pytest.raises(SnapshotError, match="target label is not one of the 6 classes"):
        step(audio, None)


def test_a_weight_norm_gain_of_the_wrong_size_is_refused_in_the_dry_run():
    model, rec, _, _, _ = _ctc_step(True)
    program = json.loads(to_json(rec.program))
    g = next(lf for lf in program["leaves"] if lf.get("name") == "conv.weight_g")
    g["shape"] = [1, 1, 1]  # the kernel reads 8 gains
    prog = decode(json.dumps(program))
    meta = {lf.ref: (lf.shape, DTYPES[lf.dtype]) for lf in prog.leaves}
    with pytest.raises(SnapshotError, match="g holds 1 values, v has 8 slices"):
        dry_run(prog, meta)


class Needs(nn.Module):
    def __init__(self, width, depth=2):
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


class Keeps(nn.Module):
    def __init__(self, width, depth=2):
        super().__init__()
        self.width, self.depth = width, depth
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def test_the_fallback_recipe_records_constructor_arguments_or_no_factory():
    spec, args, _ = recipe(nn.Linear(3, 4, bias=False), None)
    assert spec == "torch.nn.modules.linear:Linear" and json.loads(args) == {"in_features": 3, "out_features": 4}
    spec, args, why = recipe(Needs(5), None)
    assert spec is None and "Needs(width)" in why and "factory=" in why
    spec, args, _ = recipe(Keeps(5, depth=3), None)
    assert json.loads(args) == {"width": 5, "depth": 3}
    assert recipe(Keeps(5), "pkg.mod:build") == ("pkg.mod:build", None, "given")


class Limits(nn.Module):
    def __init__(self, width, limit=(0.0, float("inf"))):
        super().__init__()
        self.width, self.limit = width, limit
        self.net = nn.Linear(width, width)


def test_a_non_finite_constructor_argument_is_recorded_as_strict_json_and_rebuilt():
    # Mamba2-style configs keep time_step_limit=(0.0, inf): the guard wrote no snapshot at all ("Out of range
    # float values are not JSON compliant"), in every bamba / mamba2 / zamba2 run
    spec, args, _ = recipe(Limits(4, limit=(0.0, float("inf"))), None)
    assert "Infinity" not in args and json.loads(args)["limit"] == [0.0, {"f": "inf"}]
    rebuilt = build_model(spec, args)
    assert rebuilt.width == 4 and list(rebuilt.limit) == [0.0, float("inf")]


def test_a_config_with_a_non_finite_value_is_rebuilt():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Mamba2Config(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_heads=2, head_dim=16,
                                    state_size=4, n_groups=1, expand=2, time_step_limit=(0.0, float("inf")))
    model = transformers.Mamba2ForCausalLM(cfg)
    spec, args, _ = recipe(model, None)
    assert spec.endswith(":Mamba2ForCausalLM") and "Infinity" not in args
    rebuilt = build_model(spec, args)
    assert tuple(rebuilt.config.time_step_limit) == (0.0, float("inf"))


def test_a_transformers_model_is_rebuilt_from_its_class_and_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=20)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    spec, args, _ = recipe(model, None)
    assert spec.endswith(":GPT2LMHeadModel") and json.loads(args)["config"]["config_class"].endswith(":GPT2Config")
    rebuilt = build_model(spec, args)
    assert type(rebuilt) is type(model) and rebuilt.config.n_embd == 16
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}


def test_trust_rebuilds_a_transformers_model_no_program_was_recorded_for(tmp_path):
    transformers = pytest.importorskip("transformers")
    from nanreplay.analysis import analyze

    cfg = transformers.Wav2Vec2Config(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
                                      layerdrop=0.0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(cfg)
    guard = NanGuard(model, None, folder=tmp_path, export=False)  # as if the step could not be recorded
    batch = {"input_values": torch.randn(2, 400), "labels": torch.randint(1, 12, (2, 60))}
    guard.begin(batch, step=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not guard.loss_ok(model(**batch).loss)
    d = torch.load(guard.last_snapshot, weights_only=True)
    assert d["model"]["factory"].endswith(":Wav2Vec2ForCTC") and "config_class" in d["model"]["arguments"]
    a = analyze(guard.last_snapshot, trust=True, verify=False).to_json()
    assert a["model"]["how"].startswith("factory") and a["verdict"] == "culprit_found"
    assert a["culprit"]["op"] == "aten._ctc_loss.Tensor"


class HostRandomMask(nn.Module):
    """Masks time steps drawn from numpy's and Python's global generators, as wav2vec2's SpecAugment does."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.embed = nn.Parameter(torch.randn(8))

    def forward(self, x):
        import random

        import numpy as np
        mask = torch.from_numpy(np.random.rand(*x.shape[:2]) < 0.5)
        mask[:, random.randrange(x.shape[1])] = True
        return self.proj(torch.where(mask[..., None], self.embed, x)).pow(2).mean()


def test_a_step_that_draws_from_numpy_and_python_random_is_recorded_as_it_ran(tmp_path):
    import numpy as np

    from nanreplay import formats

    model = HostRandomMask().train()
    guard = NanGuard(model, None, folder=tmp_path, loss_fn=None)
    x = torch.randn(2, 16, 8)
    guard.begin(x, step=0)
    loss = model(x)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    np.random.rand(100)  # the loop goes on drawing before the guard records the step
    d = guard.to_dict("loss")
    guard.close()
    assert d["step_program"] is not None, d.get("program_error")
    torch.save(d, tmp_path / "s.pt")
    subject = formats.rebuild(formats.load(str(tmp_path / "s.pt")), model=None, loss=None, device="cpu", trust=False)
    subject.prepare()
    replayed = subject.loss(subject.forward())
    replayed.backward()
    assert torch.equal(replayed.detach(), loss.detach())
    for n, p in subject.model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


class Chunks(nn.Module):
    """Longformer's overlapping chunks (as_strided over a transposed tensor) and adaptive_avg_pool1d's restride."""

    def __init__(self, write=False, gaps=False):
        super().__init__()
        self.proj, self.write, self.gaps = nn.Linear(8, 8), write, gaps

    def forward(self, x):
        h = self.proj(x).transpose(0, 1)  # (16, 2, 8), strides (8, 128, 1)
        if self.gaps:
            h = h[::2]
        n = h.shape[0] // 4 - 1  # windows of 8 steps, overlapping by 4
        chunks = h.as_strided((n, 8, 2, 8), (4 * h.stride(0), h.stride(0), h.stride(1), 1))
        if self.write:
            chunks.mul_(2)
        pooled = nn.functional.adaptive_avg_pool1d(chunks.reshape(1, -1, 8), 1)
        return chunks.pow(2).mean() + pooled.mean()


def _chunks_snapshot(folder):
    """(snapshot dict, eager loss, eager grads) of one guarded step of `Chunks`."""
    torch.manual_seed(0)
    model = Chunks()
    x = torch.randn(2, 16, 8)
    guard = NanGuard(model, None, folder=folder, loss_fn=None)
    guard.begin(x, step=0)
    loss = model(x)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    d = guard.to_dict("loss")
    guard.close()
    return d, loss.detach(), grads


def _replay(d, folder):
    from nanreplay import formats

    torch.save(d, folder / "s.pt")
    subject = formats.rebuild(formats.load(str(folder / "s.pt")), model=None, loss=None, device="cpu", trust=False)
    subject.prepare()
    replayed = subject.loss(subject.forward())
    replayed.backward()
    return replayed.detach(), {n: p.grad for n, p in subject.model.named_parameters()}


def test_as_strided_is_recorded_as_take_and_replays_bit_for_bit(tmp_path):
    """The take carries the view's strides and the replay makes that view: a contiguous copy would be summed in
    another order downstream (`chunks.pow(2).mean()`), which differs in the last bit on AVX-512 CPUs."""
    torch.manual_seed(0)
    model = Chunks()
    x = torch.randn(2, 16, 8)
    rec = record_step(lambda: model(x), lambda out: out, model=model, batch={"inputs": x})
    ops = [n["op"] for n in rec.program["nodes"]]
    assert not any("as_strided" in o for o in ops) and "aten.take.default" in ops
    take = next(n for n in rec.program["nodes"] if n["op"] == "aten.take.default")
    assert take["view"] == [[32, 8, 128, 1], 0]  # as_strided over h (strides 8, 128, 1): the view's own strides
    d, loss, grads = _chunks_snapshot(tmp_path)
    replayed, replayed_grads = _replay(d, tmp_path)
    assert torch.equal(replayed, loss)  # the same computation on the same machine: bit for bit
    for n, g in replayed_grads.items():
        assert torch.equal(g, grads[n]), n


@pytest.mark.parametrize("lie,why", [("stride", "not the view its strides describe"),
                                     ("not a take", "view is \\[strides, offset\\] of a take")])
def test_a_view_the_index_does_not_describe_is_refused(tmp_path, lie, why):
    """The view is made only where the file's index is that view's (the index's bounds are checked first): strides
    that would read elsewhere, or a view on another op, are an invalid program, refused before they are used."""
    import json

    from nanreplay.errors import SnapshotError

    d, _, _ = _chunks_snapshot(tmp_path)
    prog = json.loads(d["step_program"])
    take = next(n for n in prog["nodes"] if n["op"] == "aten.take.default")
    if lie == "stride":
        take["view"][0][0] *= 2  # windows 64 apart: past the 256 elements (the index still says 32)
    else:
        next(n for n in prog["nodes"] if n["op"] == "aten.addmm.default")["view"] = take.pop("view")
    d["step_program"] = json.dumps(prog)
    with pytest.raises(SnapshotError, match=why):
        _replay(d, tmp_path)


@pytest.mark.parametrize("what,why", [("write", "writes into an as_strided view"), ("gaps", "gaps or overlaps")])
def test_as_strided_that_a_take_cannot_replay_is_refused_with_the_reason(what, why):
    from nanreplay.capture.program import NotRecordable

    model = Chunks(**{what: True})
    x = torch.randn(2, 16, 8)
    with pytest.raises(NotRecordable, match=why):
        record_step(lambda: model(x), lambda out: out, model=model, batch={"inputs": x})


def _eager_and_replayed(model, x, folder):
    """(eager loss, eager grads, replayed loss, replayed grads) of one step the guard recorded."""
    from nanreplay import formats

    guard = NanGuard(model, None, folder=folder, loss_fn=None)
    guard.begin(x, step=0)
    loss = model(x)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    d = guard.to_dict("loss")
    guard.close()
    assert d["step_program"] is not None, d.get("program_error")
    torch.save(d, folder / "s.pt")
    subject = formats.rebuild(formats.load(str(folder / "s.pt")), model=None, loss=None, device="cpu", trust=False)
    subject.prepare()
    replayed = subject.loss(subject.forward())
    replayed.backward()
    return loss.detach(), grads, replayed.detach(), {n: p.grad for n, p in subject.model.named_parameters()}


@pytest.mark.parametrize("training", [True, False])
def test_rrelu_replays_its_drawn_slopes_bit_for_bit(training, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.RReLU(), nn.Linear(16, 1)).train(training)
    x = torch.randn(6, 8)
    wrapped = _MeanOf(model)
    loss, grads, replayed, rgrads = _eager_and_replayed(wrapped, x, tmp_path)
    assert torch.equal(loss, replayed)
    assert all(torch.equal(grads[n], rgrads[n]) for n in grads)


class _MeanOf(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).pow(2).mean()
