"""Crafted files aimed at kernels that trust their companions' shapes (round 4, docs/trust.md): each calls an
allowlisted kernel directly with arguments its public form would have compared, and that its meta kernel does not
look at, so the dry run passed them. Before the checks in formats/gradchecks.py and opchecks' embedding_bag rule,
the kernels read the heap into the result or wrote past their output (SIGSEGV, glibc abort). Each is analyzed
with `--no-confine`, so a kernel that ran shows as exit 0 or a signal, not as the sandbox's contained crash line.

The second test runs the same rules on the arguments torch itself passes these kernels in real steps (autograd
of LayerNorm, log_softmax and softmax under create_graph, nn.EmbeddingBag with include_last_offset): the checks
refuse only what no real step makes. (`torch.cholesky_solve` calls `_cholesky_solve_helper` below the dispatcher on
the CPU, after broadcasting: a program holds it only if a crafted file puts it there.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from crafting import R, analyze_crafted, assert_one_line_refusal, with_nodes
from torch.utils._python_dispatch import TorchDispatchMode

from nanreplay.formats import opchecks

F32, I64 = "float32", "int64"
ROWS = 8
LN = {"x": torch.randn(ROWS, 4), "w": torch.ones(4), "b": torch.zeros(4)}


def _layer_norm_backward(g: torch.Tensor, mean: torch.Tensor) -> callable:
    return lambda d: with_nodes(d, {**LN, "g": g, "m": mean, "r": torch.ones_like(mean)}, [
        ("aten.native_layer_norm_backward.default", [R("g"), R("x"), [4], R("m"), R("r"), R("w"), R("b"),
                                                     [True, True, True]], {},
         [[[ROWS, 4], F32], [[4], F32], [[4], F32]])])


# name -> (build(d) -> d, words of the refusal)
CASES = {
    "layer-norm backward with 1-element statistics for 8 rows (reads the heap into grad_weight)": (
        _layer_norm_backward(torch.randn(ROWS, 4), torch.zeros(1)), ("mean holds 1 values",)),
    "layer-norm backward with a 1-row gradient for 8 rows (reads past it)": (
        _layer_norm_backward(torch.randn(1, 4), torch.zeros(ROWS, 1)), ("grad_out is [1, 4]",)),
    "log-softmax backward with a 1-row output for an 8-row gradient (reads past it)": (
        lambda d: with_nodes(d, {"g": torch.randn(ROWS, 4), "o": torch.randn(1, 4)}, [
            ("aten._log_softmax_backward_data.default", [R("g"), R("o"), 1, torch.float32], {}, [[[ROWS, 4], F32]])]),
        ("grad_output is [8, 4] but output is [1, 4]",)),
    "cholesky_solve_helper with 64 matrices for one right-hand side (heap corruption, glibc abort)": (
        lambda d: with_nodes(d, {"b": torch.ones(1, 4, 1), "A": torch.eye(4).expand(64, 4, 4).contiguous()}, [
            ("aten._cholesky_solve_helper.default", [R("b"), R("A"), False], {}, [[[1, 4, 1], F32]])]),
        ("batch [64] is not self's [1]",)),
    "embedding_bag max mode, include_last_offset, offsets opening no bag (writes into a 0-row output, SIGSEGV)": (
        lambda d: with_nodes(d, {"w": torch.randn(4, 2), "i": torch.tensor([0, 1]), "o": torch.tensor([0])}, [
            ("aten._embedding_bag.default", [R("w"), R("i"), R("o"), False, 2, False, None, True, -1], {},
             [[[0, 2], F32], [[0], I64], [[0], I64], [[0, 2], I64]])]),
        ("include_last_offset", "at least one bag")),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernels")
    return folder, analyze_crafted(folder, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_a_kernel_that_trusts_its_companions_shapes_is_never_reached(results, name):
    folder, got = results
    assert_one_line_refusal(got[name], "invalid step program", *CASES[name][1])
    assert not list(folder.glob("c*.json"))


class _Calls(TorchDispatchMode):
    """Every call of the packets the new rules cover, with its arguments, as torch makes it."""

    PACKETS = ("native_layer_norm_backward", "_log_softmax_backward_data", "_softmax_backward_data", "_embedding_bag")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.__name__.split(".")[0]
        if packet in self.PACKETS:
            self.calls.append((func, packet, list(args), dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


def test_the_arguments_real_steps_pass_these_kernels_are_not_refused():
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(6)
    bag = torch.nn.EmbeddingBag(10, 3, mode="max", include_last_offset=True)
    x = torch.randn(2, 5, 6, requires_grad=True)
    with _Calls() as mode:
        y = ln(x)
        (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)  # the backward kernels, as forward ops
        (gx2,) = torch.autograd.grad(F.log_softmax(x, -1).sum() + F.softmax(x, -1).pow(2).sum(), x, create_graph=True)
        (gx + gx2).sum().backward()
        bag(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2, 4]))
        bag(torch.tensor([], dtype=torch.long), torch.tensor([0]))  # no indices, no bag
    packets = {p for _, p, _, _ in mode.calls}
    assert packets >= {"native_layer_norm_backward", "_log_softmax_backward_data", "_softmax_backward_data",
                       "_embedding_bag"}, packets
    for func, packet, args, kwargs in mode.calls:
        opchecks.check(func, packet, args, kwargs, opchecks.real_values)  # raises Refused on a false refusal


@pytest.mark.parametrize("packet,args", [
    ("native_layer_norm_backward", lambda: [torch.ones(8, 4), torch.ones(8, 4), [4], torch.zeros(1), torch.ones(1),
                                            torch.ones(4), torch.zeros(4), [True, True, True]]),
    ("_log_softmax_backward_data", lambda: [torch.ones(8, 4), torch.ones(1, 4), 1, torch.float32]),
    ("_cholesky_solve_helper", lambda: [torch.ones(64, 4, 1), torch.eye(4)[None], False]),
])
def test_the_rules_refuse_on_the_meta_device_too(packet, args):
    """The dry run knows only shapes: every rule here is a shape rule, so a meta call is refused the same way."""
    op = getattr(torch.ops.aten, packet).default
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args()]
    with pytest.raises(opchecks.Refused):
        opchecks.check(op, packet, meta, {}, lambda t: None)
