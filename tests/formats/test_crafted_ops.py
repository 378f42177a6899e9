"""Crafted step programs aimed at kernels that trust their arguments, analyzed by `nanreplay analyze` in a
child interpreter (tests/crafting.py): a regression that crashes torch fails its case instead of killing
pytest. Every file is refused with one line and exit 2 (or analyzed cleanly where it is honest), no signal,
nothing written, no memory word in what is printed.

Families (issue 25): stored and computed index values, int-coded enums, plain-value overloads, integer
division traps, fused attention with zero-length dimensions, RNN hidden sizes, split sizes, kernel
messages that carry values; memory bounds (expand+unbind, a stride-0 stored buffer, nonzero's declared
size) run in their own process with their peak RSS measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from crafting import ROOT, R, assert_one_line_refusal, run_cli_cases, save, valid_snapshot, with_nodes, with_program

from nanreplay import NanGuard

BIG = 2**40
I64_MIN = -(2**63)
F32, I64 = "float32", "int64"


def _t(*v, dtype=torch.int64):
    return torch.tensor(list(v), dtype=dtype)


G34 = torch.ones(3, 4)
W10 = torch.randn(10, 4)
X34 = torch.randn(3, 4)
BAG_META = [[[2, 4], F32], [[3], I64], [[2], I64], [[2], I64]]

# name -> (stored tensors, nodes (op, args, kwargs, meta), words of the refusal)
REFUSED: dict[str, tuple[dict, list, tuple]] = {
    # ---- index values the kernel trusts (stored: refused by the dry run)
    "embedding_dense_backward 2**40 (OOB write)": (
        {"g": G34, "i": _t(BIG, 0, 1)},
        [("aten.embedding_dense_backward.default", [R("g"), R("i"), 10, -1, True], {}, [[[10, 4], F32]])],
        ("indices",)),
    "embedding_dense_backward negative": (
        {"g": G34, "i": _t(-5, 0, 1)},
        [("aten.embedding_dense_backward.default", [R("g"), R("i"), 10, -1, True], {}, [[[10, 4], F32]])],
        ("indices",)),
    "_embedding_bag negative offset (heap read)": (
        {"w": W10, "i": _t(1, 2, 3), "o": _t(0, -4099)},
        [("aten._embedding_bag.default", [R("w"), R("i"), R("o")], {}, BAG_META)], ("offsets",)),
    "_embedding_bag decreasing offsets": (
        {"w": W10, "i": _t(1, 2, 3), "o": _t(2, 0)},
        [("aten._embedding_bag.default", [R("w"), R("i"), R("o")], {}, BAG_META)], ("offsets",)),
    "_embedding_bag index": (
        {"w": W10, "i": _t(1, BIG, 3), "o": _t(0, 1)},
        [("aten._embedding_bag.default", [R("w"), R("i"), R("o")], {}, BAG_META)], ("indices",)),
    "gather": ({"x": X34, "i": _t(BIG).view(1, 1)},
               [("aten.gather.default", [R("x"), 1, R("i")], {}, [[[1, 1], F32]])], ("index",)),
    "scatter_add": ({"x": X34, "i": _t(BIG).view(1, 1), "s": torch.ones(1, 1)},
                    [("aten.scatter_add.default", [R("x"), 1, R("i"), R("s")], {}, [[[3, 4], F32]])], ("index",)),
    "index_select": ({"x": X34, "i": _t(BIG)},
                     [("aten.index_select.default", [R("x"), 0, R("i")], {}, [[[1, 4], F32]])], ("index",)),
    "index_put accumulate": ({"x": X34, "i": _t(BIG), "v": torch.ones(4)},
                             [("aten.index_put.default", [R("x"), [R("i")], R("v"), True], {}, [[[3, 4], F32]])],
                             ("index",)),
    "take": ({"x": X34, "i": _t(-BIG)}, [("aten.take.default", [R("x"), R("i")], {}, [[[1], F32]])], ("index",)),
    # ---- issue 36: scatter-based GNNs, the FFT family, torch.distributions' validation
    "scatter_reduce_ index 2**40": (
        {"x": X34, "i": _t(BIG, 0, 0, 0).view(1, 4), "s": torch.ones(1, 4)},
        [("aten.scatter_reduce_.two", [R("x"), 0, R("i"), R("s"), "sum"], {}, [[[3, 4], F32]])], ("index",)),
    "scatter_reduce_ negative index": (
        {"x": X34, "i": _t(-1, 0, 0, 0).view(1, 4), "s": torch.ones(1, 4)},
        [("aten.scatter_reduce_.two", [R("x"), 0, R("i"), R("s"), "amax"], {"include_self": False},
          [[[3, 4], F32]])], ("index",)),
    "scatter_reduce_ index larger than src": (
        {"x": X34, "i": _t(0, 1, 2, 0, 1, 2, 0, 1).view(2, 4), "s": torch.ones(1, 4)},
        [("aten.scatter_reduce_.two", [R("x"), 0, R("i"), R("s"), "sum"], {}, [[[3, 4], F32]])], ("src",)),
    "scatter_reduce_ index wider than self": (
        {"x": X34, "i": _t(0, 1, 2, 0, 1).view(1, 5), "s": torch.ones(1, 5)},
        [("aten.scatter_reduce_.two", [R("x"), 0, R("i"), R("s"), "sum"], {}, [[[3, 4], F32]])], ("outside dim",)),
    "scatter_reduce_ reduce 'xor'": (
        {"x": X34, "i": _t(0, 1, 2, 0).view(1, 4), "s": torch.ones(1, 4)},
        [("aten.scatter_reduce_.two", [R("x"), 0, R("i"), R("s"), "xor"], {}, [[[3, 4], F32]])], ("reduce",)),
    "index_add_ source of the wrong size": (
        {"x": X34, "i": _t(2), "s": torch.ones(2, 4)},
        [("aten.index_add_.default", [R("x"), 0, R("i"), R("s")], {}, [[[3, 4], F32]])], ("source",)),
    "computed index reaches scatter_reduce_": (
        {"x": X34, "i": _t(0, 1, 2, 0).view(1, 4), "s": torch.ones(1, 4)},
        [("aten.add.Tensor", [R("i"), BIG], {}, [[[1, 4], I64]]),
         ("aten.scatter_reduce_.two", [R("x"), 0, R(0), R("s"), "sum"], {}, [[[3, 4], F32]])],
        ("index", "nothing was run")),
    "_fft_r2c dim 5 of a 2-d input": (
        {"x": X34}, [("aten._fft_r2c.default", [R("x"), [5], 0, True], {}, [[[3, 3], "complex64"]])], ("dim",)),
    "_fft_r2c normalization 200": (
        {"x": X34}, [("aten._fft_r2c.default", [R("x"), [1], 200, True], {}, [[[3, 3], "complex64"]])],
        ("normalization",)),
    "_fft_c2r last_dim_size 2**40 (reads past the input)": (
        {"c": torch.randn(3, 3, dtype=torch.complex64)},
        [("aten._fft_c2r.default", [R("c"), [1], 2, BIG], {}, [[[3, 4], F32]])], ("last_dim_size",)),
    "_fft_c2c of an empty dimension": (
        {"c": torch.randn(3, 0, dtype=torch.complex64)},
        [("aten._fft_c2c.default", [R("c"), [1], 0, True], {}, [[[3, 0], "complex64"]])], ("empty",)),
    "_fft_c2c of a real input": (
        {"x": X34}, [("aten._fft_c2c.default", [R("x"), [1], 0, True], {}, [[[3, 4], "complex64"]])],
        ("complex",)),
    "a complex literal that is not two numbers": (
        {"x": X34}, [("aten.mul.Tensor", [R("x"), {"c": ["nan", 1, 2]}], {}, [[[3, 4], F32]])], ("number",)),
    "_is_all_true of a float tensor": (
        {"x": X34}, [("aten._is_all_true.default", [R("x")], {}, [[[], "bool"]])], ("bool",)),
    # ---- issue 38: derivative kernels of a double backward (WGAN-GP's penalty)
    # (a gradient that broadcasts against the input is vmap(jacrev)'s, and the elementwise kernel broadcasts safely)
    "hardtanh_backward whose gradient does not broadcast against its input": (
        {"g": torch.ones(3, 5), "x": X34},
        [("aten.hardtanh_backward.default", [R("g"), R("x"), -1.0, 1.0], {}, [[[3, 4], F32]])], ("broadcast",)),
    "mse_loss_backward with an unknown reduction code": (
        {"g": torch.ones(()), "x": X34},
        [("aten.mse_loss_backward.default", [R("g"), R("x"), R("x"), 200], {}, [[[3, 4], F32]])], ("reduction",)),
    "gelu_backward with an approximation it does not know": (
        {"g": G34, "x": X34},
        [("aten.gelu_backward.default", [R("g"), R("x")], {"approximate": "exact"}, [[[3, 4], F32]])],
        ("approximate",)),
    "_linalg_eigh with a UPLO it does not know": (
        {"a": torch.eye(3)},
        [("aten._linalg_eigh.default", [R("a")], {"UPLO": "X"}, [[[3], F32], [[3, 3], F32]])], ("UPLO",)),
    "_linalg_eigh of a matrix that is not square": (
        {"a": X34},
        [("aten._linalg_eigh.default", [R("a")], {}, [[[3], F32], [[3, 3], F32]])], ("square",)),
    "_assert_async from a validation": (
        {"b": torch.ones((), dtype=torch.bool)}, [("aten._assert_async.msg", [R("b"), "x"], {}, [])], ("allowlist",)),
    # ---- computed index values: refused by the replay, before the kernel
    "computed index reaches embedding_dense_backward": (
        {"g": G34, "i": _t(1, 0, 1)},
        [("aten.add.Tensor", [R("i"), BIG], {}, [[[3], I64]]),
         ("aten.embedding_dense_backward.default", [R("g"), R(0), 10, -1, True], {}, [[[10, 4], F32]])],
        ("indices", "nothing was run")),
    # ---- int-coded enums and dtype codes
    "to.prim_dtype code 200": ({"x": X34}, [("aten.to.prim_dtype", [R("x"), 200, False, False], {}, [[[3, 4], F32]])],
                               ("allowlist",)),
    "mse_loss reduction 200": ({"x": X34}, [("aten.mse_loss.default", [R("x"), R("x"), 200], {}, [[[], F32]])],
                               ("reduction",)),
    "_embedding_bag mode 200": ({"w": W10, "i": _t(1, 2, 3), "o": _t(0, 1)},
                                [("aten._embedding_bag.default", [R("w"), R("i"), R("o"), False, 200], {}, BAG_META)],
                                ("mode",)),
    "grid_sampler_2d mode 200": ({"x": torch.randn(1, 1, 4, 4), "g": torch.zeros(1, 2, 2, 2)},
                                 [("aten.grid_sampler_2d.default", [R("x"), R("g"), 200, 0, False], {},
                                   [[[1, 1, 2, 2], F32]])], ("interpolation_mode",)),
    # ---- plain-value overloads (the dry run would run them on Python ints: SIGFPE)
    "remainder.int by zero": ({}, [("aten.remainder.int", [5, 0], {}, [])], ("allowlist",)),
    "gcd.int": ({}, [("aten.gcd.int", [0, 0], {}, [])], ("allowlist",)),
    "add.default on two numbers": ({}, [("aten.add.default", [1, 2], {}, [])], ("allowlist",)),
    # ---- integer division traps
    "div trunc INT64_MIN / -1 (SIGFPE)": (
        {"a": _t(I64_MIN), "b": _t(-1)},
        [("aten.div.Tensor_mode", [R("a"), R("b")], {"rounding_mode": "trunc"}, [[[1], I64]])], ("smallest integer",)),
    "div trunc INT32_MIN / -1 literal": (
        {"a": _t(-(2**31), dtype=torch.int32)},
        [("aten.div.Scalar_mode", [R("a"), -1], {"rounding_mode": "trunc"}, [[[1], "int32"]])], ("smallest integer",)),
    "div trunc INT64_MIN / -1 as plain numbers": (
        {}, [("aten.div.Tensor_mode", [I64_MIN, -1], {"rounding_mode": "trunc"}, [[[], I64]])], ("smallest integer",)),
    "remainder by a stored zero": ({"a": _t(7), "b": _t(0)},
                                   [("aten.remainder.Tensor", [R("a"), R("b")], {}, [[[1], I64]])], ("by zero",)),
    "floor_divide by a literal zero": ({"a": _t(7)}, [("aten.floor_divide.Scalar", [R("a"), 0], {}, [[[1], I64]])],
                                       ("by zero",)),
    "computed INT64_MIN / -1": (
        {"b": _t(-1, -1)},
        [("aten.full.default", [[2], I64_MIN], {"dtype": torch.int64}, [[[2], I64]]),
         ("aten.div.Tensor_mode", [R(0), R("b")], {"rounding_mode": "trunc"}, [[[2], I64]])],
        ("smallest integer", "nothing was run")),
    # ---- fused attention with zero-length dimensions (SIGFPE in the CPU flash kernel)
    "flash attention, zero-length keys": (
        {"q": torch.randn(1, 2, 4, 8), "k": torch.randn(1, 2, 0, 8)},
        [("aten._scaled_dot_product_flash_attention_for_cpu.default", [R("q"), R("k"), R("k")], {},
          [[[1, 2, 4, 8], F32], [[1, 2, 4], F32]])], ("zero-length",)),
    "flash attention, zero-length queries": (
        {"q": torch.randn(1, 2, 0, 8), "k": torch.randn(1, 2, 4, 8)},
        [("aten._scaled_dot_product_flash_attention_for_cpu.default", [R("q"), R("k"), R("k")], {},
          [[[1, 2, 0, 8], F32], [[1, 2, 0], F32]])], ("zero-length",)),
    "flash attention, values shorter than keys": (
        {"q": torch.randn(1, 2, 4, 8), "v": torch.randn(1, 2, 5, 8)},
        [("aten._scaled_dot_product_flash_attention_for_cpu.default", [R("q"), R("q"), R("v")], {},
          [[[1, 2, 4, 8], F32], [[1, 2, 4], F32]])], ("do not fit",)),
    # ---- split sizes
    "split_with_sizes that do not add up": ({"x": torch.randn(3)},
                                            [("aten.split_with_sizes.default", [R("x"), [5, -2]], {},
                                              [[[5], F32], [[0], F32]])], ("split sizes",)),
}


def _lstm_snapshot(folder: Path) -> tuple[Path, dict]:
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(4, 8)

        def forward(self, x):
            return torch.log(torch.relu(self.rnn(x)[0]) - 1).mean()

    m = Net()
    guard = NanGuard(m, folder=folder / "lstm")
    x = torch.randn(5, 2, 4)
    guard.begin(x)
    assert not guard.loss_ok(m(x))
    return Path(guard.last_snapshot), torch.load(guard.last_snapshot, weights_only=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every crafted file of this module, analyzed in one child interpreter."""
    base = tmp_path_factory.mktemp("crafted_ops")
    valid_path, _ = valid_snapshot(base)
    cases = []

    def add(name: str, d: dict | None, *extra: str, path: Path | None = None, cwd: Path | None = None):
        folder = base / f"case{len(cases)}"
        folder.mkdir()
        p = path or save(d, folder / "crafted.pt")
        cases.append({"name": name, "cwd": str(cwd or folder),
                      "args": ["analyze", str(p), "-o", str(folder / "r.html"), "--json", str(folder / "r.json"),
                               *extra]})
        return folder

    for name, (tensors, nodes, _) in REFUSED.items():
        add(name, with_nodes(torch.load(valid_path, weights_only=True), tensors, nodes))
    # an RNN whose hidden size disagrees with its weights (the kernel sizes its buffers from it), and the honest one
    lstm_path, lstm = _lstm_snapshot(base)

    def hidden(prog, size=1000):
        node = next(n for n in prog["nodes"] if n["op"] == "aten.mkldnn_rnn_layer.default")
        node["args"][10] = size
    add("mkldnn_rnn_layer hidden_size 1000", with_program(lstm, hidden))
    add("mkldnn_rnn_layer honest", None, path=lstm_path)
    # a kernel message that carries a value: the one line names the op and node, without the value
    add("nll_loss target 2**40: the kernel's message", with_nodes(
        torch.load(valid_path, weights_only=True), {"x": X34, "t": _t(0, 1, BIG)},
        [("aten.nll_loss_forward.default", [R("x"), R("t"), None, 1, -100], {}, [[[], F32], [[], F32]])]))
    add("honest", None, path=valid_path)
    out = run_cli_cases(cases)
    return {c["name"]: {**out[c["name"]], "folder": Path(c["cwd"])} for c in cases}


def _nothing_written(r: dict) -> None:
    assert sorted(x.name for x in r["folder"].iterdir()) == ["crafted.pt"], list(r["folder"].iterdir())


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_crafted_call_is_refused_before_its_kernel_runs(results, name):
    r = results[name]
    err = assert_one_line_refusal(r, "invalid step program", *REFUSED[name][2])
    assert "node " in err
    _nothing_written(r)


def test_an_rnn_hidden_size_that_disagrees_with_its_weights(results):
    assert_one_line_refusal(results["mkldnn_rnn_layer hidden_size 1000"], "aten.mkldnn_rnn_layer", "hidden_size")
    _nothing_written(results["mkldnn_rnn_layer hidden_size 1000"])
    honest = results["mkldnn_rnn_layer honest"]
    assert honest["code"] == 0 and honest.get("signal") is None, honest


def test_a_kernel_message_is_quoted_without_its_values(results):
    r = results["nll_loss target 2**40: the kernel's message"]
    assert_one_line_refusal(r, "aten.nll_loss_forward.default at node 0", code=1)
    assert str(BIG) not in r["out"] + r["err"]
    _nothing_written(r)


def test_the_honest_step_still_analyzes(results):
    r = results["honest"]
    assert r["code"] == 0 and r.get("signal") is None, r
    assert json.loads((r["folder"] / "r.json").read_text())["verdict"] == "culprit_found"


# ---------------------------------------------------------------- memory: bounded before anything is built


_PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
         "sys.stderr.write(r.stderr); print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _cli_peak(args: list[str], cwd: Path) -> tuple[int, str, int]:
    """`nanreplay ARGS` in its own process: (exit code or -signal, stderr, its peak RSS in bytes)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-m", "nanreplay.cli", *args], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=300)
    code, rss_kib = res.stdout.split()
    return int(code), res.stderr, int(rss_kib) * 1024


MEMORY = {
    "expand to 10**7 then unbind": (
        {"x": torch.randn(1, 1)},
        [("aten.expand.default", [R("x"), [10**7, 1]], {}, [[[10**7, 1], F32]]),
         ("aten.unbind.int", [R(0)], {}, [[[1], F32]] * 3)], "tensors"),
    "nonzero that declares one row": (
        {"m": torch.ones(1, 1, dtype=torch.bool)},
        [("aten.expand.default", [R("m"), [20_000, 20_000]], {}, [[[20_000, 20_000], "bool"]]),
         ("aten.nonzero.default", [R(0)], {}, [[[1, 2], I64]])], "--max-memory"),
}


@pytest.mark.parametrize("name", [*MEMORY, "a stride-0 buffer of 10**9 elements"])
def test_memory_is_bounded_before_it_is_used(tmp_path, name):
    _, d = valid_snapshot(tmp_path)
    if name in MEMORY:
        tensors, nodes, words = MEMORY[name]
        d = with_nodes(d, tensors, nodes)
    else:
        d["state"]["fc.big"] = torch.zeros(1).expand(10**9)  # 4 bytes stored, 4 GB once copied
        words = "once copied"
    p = save(d, tmp_path / "crafted.pt")
    assert p.stat().st_size < 100_000
    work = tmp_path / "work"
    work.mkdir()
    code, err, rss = _cli_peak(["analyze", str(p), "-o", "r.html", "--max-memory", "512M"], work)
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and words in err, err
    assert rss < 1536 << 20, f"peak RSS {rss >> 20} MiB under --max-memory 512M"
    assert list(work.iterdir()) == []
