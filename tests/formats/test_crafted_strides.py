"""Crafted files aimed at kernels that ignore their arguments' strides (round 5, docs/trust.md): a program hands a
kernel a stride-0 `expand` of one value where the kernel walks `data_ptr` as a
dense block. The meta kernel checks shapes only, and the view stays inside its storage, so before the rules of
formats/layoutchecks.py the dry run and the replay's view check passed it: group norm read the heap into its output,
weight norm wrote past a 1-element storage (glibc abort), layer-norm backward and CPU flash attention read past
theirs. Each is analyzed with `--no-confine`, so a kernel that ran shows as exit 0 or a signal, not as the sandbox's
contained crash line. The second test runs the rules on the arguments torch itself passes these kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from crafting import R, analyze_crafted, assert_one_line_refusal, save, valid_snapshot, with_nodes
from torch.utils._python_dispatch import TorchDispatchMode

from nanreplay.formats import opchecks
from nanreplay.formats.layoutchecks import LAYOUT_CHECKS

F32 = "float32"
C = 4096


def _expand(name: str, shape: list[int]) -> tuple:
    return ("aten.expand.default", [R(name), shape], {}, [[shape, F32]])


_LSTM = {"w0": torch.randn(32, 4), "w1": torch.randn(32, 8), "w2": torch.randn(32), "w3": torch.randn(32),
         "h": torch.zeros(2, 8), "c": torch.zeros(2, 8)}


def _lstm_meta() -> list:
    outs = torch.ops.aten.mkldnn_rnn_layer.default(torch.randn(5, 2, 4), *_LSTM.values(), False, [], 2, 8, 1, True,
                                                   False, False, True)
    return [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in outs]


CASES = {
    "group norm with a weight expanded from one float to 4096 channels (reads the heap into its output)": (
        lambda d: with_nodes(d, {"x": torch.randn(2, C, 2), "w": torch.ones(1), "b": torch.zeros(C)}, [
            _expand("w", [C]),
            ("aten.native_group_norm.default", [R("x"), R(0), R("b"), 2, C, 2, 4, 1e-5], {},
             [[[2, C, 2], F32], [[2, 4], F32], [[2, 4], F32]])]),
        ("weight is a strided view",)),
    "group norm with a bias expanded from one float": (
        lambda d: with_nodes(d, {"x": torch.randn(2, C, 2), "w": torch.ones(C), "b": torch.zeros(1)}, [
            _expand("b", [C]),
            ("aten.native_group_norm.default", [R("x"), R("w"), R(0), 2, C, 2, 4, 1e-5], {},
             [[[2, C, 2], F32], [[2, 4], F32], [[2, 4], F32]])]),
        ("bias is a strided view",)),
    "weight norm with g expanded from one float (its norms output gets g's strides: a heap write, glibc abort)": (
        lambda d: with_nodes(d, {"v": torch.randn(C, 4), "g": torch.ones(1, 1)}, [
            _expand("g", [C, 1]),
            ("aten._weight_norm_interface.default", [R("v"), R(0), 0], {}, [[[C, 4], F32], [[C, 1], F32]])]),
        ("g is a strided view",)),
    "layer-norm backward with rstd expanded from one float to 512 rows (reads past it)": (
        lambda d: with_nodes(d, {"g": torch.randn(512, 4), "x": torch.randn(512, 4), "m": torch.zeros(512, 1),
                                 "r": torch.ones(1, 1), "w": torch.ones(4), "b": torch.zeros(4)}, [
            _expand("r", [512, 1]),
            ("aten.native_layer_norm_backward.default", [R("g"), R("x"), [4], R("m"), R(0), R("w"), R("b"),
                                                         [True, True, True]], {},
             [[[512, 4], F32], [[4], F32], [[4], F32]])]),
        ("rstd is a strided view",)),
    "embedding bag with one index expanded to 1000 (reads the heap as row numbers)": (
        lambda d: with_nodes(d, {"w": torch.randn(10, 3), "i": torch.tensor([1]), "o": torch.tensor([0])}, [
            ("aten.expand.default", [R("i"), [1000]], {}, [[[1000], "int64"]]),
            ("aten._embedding_bag.default", [R("w"), R(0), R("o"), False, 0, False, None, False, -1], {},
             [[[1, 3], F32], [[1000], "int64"], [[1], "int64"], [[1], "int64"]])]),
        ("indices is a strided view",)),
    "LSTM layer with its input expanded from one float (oneDNN reads it as dense memory)": (
        lambda d: with_nodes(d, {"x": torch.randn(1, 1, 1), **_LSTM}, [
            ("aten.expand.default", [R("x"), [5, 2, 4]], {}, [[[5, 2, 4], F32]]),
            ("aten.mkldnn_rnn_layer.default", [R(0), *(R(k) for k in _LSTM), False, [], 2, 8, 1, True, False,
                                                False, True], {}, _lstm_meta())]),
        ("input is a strided view",)),
    "antialiased resize 16 -> 4 with a scale of 1e-12 (windows of 10**12 taps: SIGSEGV)": (
        lambda d: with_nodes(d, {"x": torch.randn(1, 1, 16, 16)}, [
            ("aten._upsample_bilinear2d_aa.default", [R("x"), [4, 4], False, 1e-12, 1e-12], {},
             [[[1, 1, 4, 4], F32]])]),
        ("scales_h 1e-12 does not match the resize of 16 to 4",)),
    "CPU flash attention with a head dimension of stride 0 (reads past the query)": (
        lambda d: with_nodes(d, {"q": torch.randn(1, 2, 64, 1), "k": torch.randn(1, 2, 64, 64),
                                 "v": torch.randn(1, 2, 64, 64)}, [
            _expand("q", [1, 2, 64, 64]),
            ("aten._scaled_dot_product_flash_attention_for_cpu.default", [R(0), R("k"), R("v")], {},
             [[[1, 2, 64, 64], F32], [[1, 2, 64], F32]])]),
        ("query's last dimension has stride 0",)),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("strides")
    return folder, analyze_crafted(folder, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_a_kernel_that_ignores_strides_never_gets_a_crafted_view(results, name):
    folder, got = results
    assert_one_line_refusal(got[name], "invalid step program", *CASES[name][1])
    assert not (folder / f"c{list(CASES).index(name)}.json").exists()


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.__name__.split(".")[0]
        if packet in LAYOUT_CHECKS:
            self.calls.append((func, packet, list(args), dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


def test_the_arguments_real_steps_pass_these_kernels_are_not_refused():
    """What torch passes: GroupNorm (affine, and a weight that is an expanded view in the user's code), weight
    norm, LayerNorm's backward, attention whose query/key/value are transposed heads (not contiguous), and
    EmbeddingBag given strided indices, offsets and per-sample weights, a bidirectional batch-first LSTM given a
    transposed batch."""
    torch.manual_seed(0)
    gn = torch.nn.GroupNorm(2, 8)
    lstm = torch.nn.LSTM(6, 4, num_layers=2, batch_first=True, bidirectional=True)
    bag = torch.nn.EmbeddingBag(10, 3, mode="sum")
    wn = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(6, 8))
    ln = torch.nn.LayerNorm(6)
    x = torch.randn(3, 8, 5, requires_grad=True)
    qkv = torch.randn(2, 7, 3 * 16, requires_grad=True)
    with _Calls() as mode:
        y = gn(x).sum() + F.group_norm(x, 4, torch.ones(1).expand(8), torch.zeros(8)).sum()
        y = y + wn(torch.randn(4, 6)).sum() + ln(torch.randn(4, 6, requires_grad=True)).pow(2).sum()
        q, k, v = qkv.view(2, 7, 3, 2, 8).permute(2, 0, 3, 1, 4)  # heads transposed: strided, head dim dense
        y = y + F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()
        idx = torch.tensor([1, 0, 2, 0, 3, 0, 4, 0])
        y = y + bag(idx[::2], torch.tensor([0, 2, 9])[:2], per_sample_weights=torch.randn(8)[::2]).sum()
        y = y + bag(torch.arange(6).view(3, 2).t()).sum()  # a transposed batch of bags
        y = y + lstm(torch.randn(5, 3, 6).transpose(0, 1))[0].sum()  # batch first, given as a transposed view
        y.backward()
    packets = {p for _, p, _, _ in mode.calls}
    assert packets == set(LAYOUT_CHECKS), packets
    assert any(not a.is_contiguous() for _, p, args, _ in mode.calls if p.startswith("_scaled")
               for a in args[:3])
    for func, packet, args, kwargs in mode.calls:
        opchecks.check(func, packet, args, kwargs, opchecks.real_values)  # raises Refused on a false refusal


def test_the_rules_refuse_on_the_meta_device_too():
    """The dry run has meta tensors only: an expand there has the same strides."""
    w = torch.ones(1, device="meta").expand(C)
    x, b = torch.empty(2, C, 2, device="meta"), torch.empty(C, device="meta")
    with pytest.raises(opchecks.Refused, match="weight is a strided view"):
        opchecks.check(torch.ops.aten.native_group_norm.default, "native_group_norm", [x, w, b, 2, C, 2, 4, 1e-5],
                       {}, lambda t: None)


def test_a_later_node_reads_ctc_log_alpha_as_zeros(tmp_path, monkeypatch):
    """`_ctc_loss` fills its log_alpha output only up to each sample's lengths; the rest is whatever the heap held
    (a freed buffer's values came back in 1023 of 2100 entries). A program that reads it in a later node would
    carry heap memory into its values and the report. The replay binds zeros for it (as for oneDNN's RNN
    workspace); autograd keeps the real one for the backward."""
    from nanreplay.formats import load, native
    from nanreplay.formats.stepmodel import StepModule

    t, n, c, s = 20, 2, 6, 5
    _, d = valid_snapshot(tmp_path)
    d = with_nodes(d, {"lp": torch.randn(t, n, c).log_softmax(2), "tg": torch.randint(1, c, (n, s)),
                       "il": torch.tensor([t, 3]), "tl": torch.tensor([s, 1])}, [
        ("aten._ctc_loss.Tensor", [R("lp"), R("tg"), R("il"), R("tl"), 0, False], {},
         [[[n], F32], [[n, t, 2 * s + 1], F32]]),
        ("aten.sum.default", [R(0, 1)], {}, [[[], F32]])])
    path = save(d, tmp_path / "ctc.pt")
    seen = []
    bind = StepModule._bind

    def spy(self, node, out, env, i):
        bind(self, node, out, env, i)
        if node.name == "aten.sum.default" and not seen:
            seen.append(env[node.out])
    monkeypatch.setattr(StepModule, "_bind", spy)
    snap = load(path)
    dev = torch.device("cpu")
    subject = native.program_subject(snap, dev, None, native.replay_options(snap.raw, dev))
    subject.model(subject.inputs, subject.target)
    assert seen and float(seen[0]) == 0.0


def test_the_scales_real_antialiased_resizes_pass_are_not_refused():
    """F.interpolate(antialias=True) with a scale factor passes it to the kernel beside floor(size * factor)."""
    calls = []

    class _Aa(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_upsample_") and "_aa" in func.__name__:
                calls.append((func, func.__name__.split(".")[0], list(args), dict(kwargs or {})))
            return func(*args, **(kwargs or {}))

    x = torch.randn(1, 2, 17, 23, requires_grad=True)
    with _Aa():
        for mode in ("bilinear", "bicubic"):
            for f in (0.1, 0.37, 0.5, 1 / 3, 1.0, 1.7, 3.0):
                for recompute in (None, True):
                    F.interpolate(x, scale_factor=f, mode=mode, antialias=True,
                                  recompute_scale_factor=recompute).sum().backward()
            F.interpolate(x, size=(5, 40), mode=mode, antialias=True).sum().backward()
    assert len(calls) >= 30
    for func, packet, args, kwargs in calls:
        opchecks.check(func, packet, args, kwargs, opchecks.real_values)
