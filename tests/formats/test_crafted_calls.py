"""Crafted calls aimed at the dry run's own accounting (round 6, docs/trust.md): its cost bound counted a node's work
from the arguments given by position, and knew products, convolutions and attention but not pooling windows.

* A program may name any argument by keyword (`convolution(x, weight=w, ...)`): the work count missed the weight,
  so a convolution of 7e13 multiply-adds ran until --timeout instead of being refused at once; `masked_select(x,
  mask=m)` made the data-dependent memory bound index a missing argument (a traceback, "a bug in nanreplay").
* `aten.conv2d` (and conv1d, conv3d, the transposed ones), which real steps reach only as `convolution`, was counted
  as its elements when a program named it directly.
* A pooling kernel visits its whole window for every output: a 1024x1024 max pool of a 4 MiB zeros tensor counted
  2e6 elements and runs 1e12 comparisons (until --timeout, the analysis stalled: 20 s or 600 s, not refused).

Each file is analyzed confined, as a stranger's file is; those to refuse with `--timeout 60` (a work budget of 3e12; a
five-second one was spent by the child's start on a loaded machine).
"""

from __future__ import annotations

import json

import pytest
import torch
from crafting import R, assert_one_line_refusal, run_cli_cases, save, valid_snapshot, with_nodes

from nanreplay.formats.dryrun import by_position, node_work

F32 = "float32"


def _zeros(shape: list[int]) -> tuple:
    return ("aten.zeros.default", [shape], {"dtype": torch.float32}, [[shape, F32]])


CONV_BY_KEYWORD = [
    _zeros([1, 1, 4096, 4096]), _zeros([1, 1, 2048, 2048]),
    ("aten.convolution.default", [R(0)], {"weight": R(1), "bias": None, "stride": [1, 1], "padding": [1024, 1024],
                                          "dilation": [1, 1], "transposed": False, "output_padding": [0, 0],
                                          "groups": 1}, [[[1, 1, 4097, 4097], F32]])]

def _by_keyword(d: dict) -> dict:
    d = with_nodes(d, {"x": torch.randn(8), "m": torch.ones(8, dtype=torch.bool)}, [
        ("aten.masked_select.default", [R("x")], {"mask": R("m")}, [[[8], F32]]),
        ("aten.native_dropout.default", [R("x")], {"p": 0.5, "train": True}, [[[8], F32], [[8], "bool"]])])
    prog = json.loads(d["step_program"])
    prog["nodes"][1]["mask"] = "crafted_m"  # dropout replays its recorded mask
    d["step_program"] = json.dumps(prog)
    return d


CASES = {
    "a convolution whose weight is given by keyword (7e13 multiply-adds, uncounted)": (
        lambda d: with_nodes(d, {}, CONV_BY_KEYWORD), ("element operations", "aten.convolution")),
    "conv2d named directly (its work was counted as elements: only `convolution` was known)": (
        lambda d: with_nodes(d, {}, [*CONV_BY_KEYWORD[:2], (
            "aten.conv2d.default", [R(0), R(1), None, [1], [1024]], {}, [[[1, 1, 4097, 4097], F32]])]),
        ("element operations", "aten.conv2d")),
    "a max pool with a 2048x2048 window over a 16 MiB input (1.8e13 comparisons)": (
        lambda d: with_nodes(d, {}, [
            _zeros([1, 1, 2048, 2048]),
            ("aten.max_pool2d_with_indices.default", [R(0), [2048, 2048], [1, 1], [1024, 1024]], {},
             [[[1, 1, 2049, 2049], F32], [[1, 1, 2049, 2049], "int64"]])]), ("element operations", "max_pool2d")),
    "an average pool whose window is one number for three dimensions": (
        lambda d: with_nodes(d, {}, [
            _zeros([1, 1, 160, 160, 160]),
            ("aten.avg_pool3d.default", [R(0)], {"kernel_size": [160], "stride": [1], "padding": [80]},
             [[[1, 1, 161, 161, 161], F32]])]), ("element operations", "avg_pool3d")),
    "masked_select with its mask by keyword (the memory bound indexed a missing argument), dropout with p by "
    "keyword (the replay of its recorded mask indexed a missing argument)": (_by_keyword, None),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("calls")
    _, base = valid_snapshot(folder / "v")
    runs = []
    for i, (name, (build, _)) in enumerate(CASES.items()):
        d = {**base, "batch": dict(base["batch"]), "constants": dict(base.get("constants") or {})}
        path = save(build(d), folder / f"c{i}.pt")
        timeout = "60" if CASES[name][1] else "300"  # (a refusal comes from the count, before anything runs)
        runs.append({"name": name, "cwd": str(folder), "args": ["analyze", str(path), "--timeout", timeout, "--json",
                                                                 str(folder / f"c{i}.json"), "--no-report", "-q"]})
    return folder, run_cli_cases(runs)


@pytest.mark.parametrize("name", list(CASES))
def test_a_crafted_call_is_counted_whatever_its_arguments_are_called(results, name):
    folder, got = results
    words = CASES[name][1]
    i = list(CASES).index(name)
    if words is None:  # nothing to refuse: the analysis runs to its end, with no traceback
        r = got[name]
        assert r["code"] == 0 and "Traceback" not in r["err"] + r["out"] and not r["exc"], r
        assert (folder / f"c{i}.json").exists()
        return
    err = assert_one_line_refusal(got[name], *words)
    assert "no result after" not in err  # refused by the count, not stopped by the clock
    assert not (folder / f"c{i}.json").exists()


def test_the_work_of_a_pooling_node_is_its_outputs_times_its_window():
    x = torch.empty(2, 8, 32, 32, device="meta")
    out = [[[2, 8, 16, 16], F32], [[2, 8, 16, 16], "int64"]]
    elements = x.numel() + 2 * 2 * 8 * 16 * 16
    assert node_work("aten.max_pool2d_with_indices.default", [x, [3, 3], [2, 2], [1, 1]], out) == \
        elements + x.numel() * 9  # (the larger of the output and the input, times the window)
    assert node_work("aten.max_pool2d_with_indices.default", [x, [3], [2], [1]], out) == elements + x.numel() * 9
    g = torch.empty(2, 8, 16, 16, device="meta")
    assert node_work("aten.avg_pool2d_backward.default", [g, x, [4, 4], [2, 2], [1, 1], False, True, None],
                     [[[2, 8, 32, 32], F32]]) == g.numel() + 2 * x.numel() + x.numel() * 16


def test_keyword_arguments_take_their_schema_places():
    op = torch.ops.aten.convolution.default
    x, w = torch.empty(1, 1, 8, 8, device="meta"), torch.empty(1, 1, 3, 3, device="meta")
    pos = [x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1]
    named = by_position(op, [x], {"weight": w, "bias": None, "stride": [1, 1], "padding": [0, 0],
                                  "dilation": [1, 1], "transposed": False, "output_padding": [0, 0], "groups": 1})
    assert named == pos
    meta = [[[1, 1, 6, 6], F32]]
    assert node_work(str(op), named, meta) == node_work(str(op), pos, meta) > x.numel() + 36 + 36 * 9
    assert node_work("aten.conv2d.default", [x, w], meta) == node_work(str(op), pos, meta)
    # a default left out is its default
    assert by_position(torch.ops.aten.avg_pool2d.default, [x], {"kernel_size": [2]})[1:4] == [[2], [], [0, 0]]


def test_an_einsum_with_an_ellipsis_counts_its_multiply_adds():
    """An ellipsis used to count only the elements touched: a batched product of two expanded views, n**3
    multiply-adds per matrix, was counted as a few n**2."""
    n = 2**12
    x = torch.empty(1, 1, 1, device="meta").expand(3, n, n)
    out = [[[3, n, n], F32]]
    elements = 3 * 3 * n * n
    assert node_work("aten.einsum.default", ["...ij,...jk->...ik", [x, x]], out) == elements + 3 * n**3
    assert node_work("aten.einsum.default", ["bij,bjk->bik", [x, x]], out) == elements + 3 * n**3
    y = torch.empty(n, n, device="meta")  # broadcast against the batch: still 3 products
    assert node_work("aten.einsum.default", ["...ij,...jk->...ik", [x, y]], out) == 2 * elements // 3 + n * n + \
        3 * n**3


def test_an_indexed_write_counts_every_slice_it_names():
    """index_put broadcasts a 1-element value to every slice its indices name, index_fill fills a slice per index,
    an embedding bag adds a weight row per index: 10**5 zero indices into a [1, 10**4] tensor are 10**9 writes
    (half a second here), counted before as the 10**5 + 2 * 10**4 elements of the arguments and output."""
    x, v = torch.empty(1, 10**4, device="meta"), torch.empty(1, device="meta")
    i = torch.empty(10**5, dtype=torch.long, device="meta")
    out = [[[1, 10**4], F32]]
    assert node_work("aten.index_put.default", [x, [i], v, True], out) >= 10**9
    assert node_work("aten.index_put_.default", by_position(torch.ops.aten.index_put_.default, [x],
                                                              {"indices": [i], "values": v}), out) >= 10**9
    assert node_work("aten.index_fill.int_Scalar", [x, 0, i, 1.0], out) >= 10**9
    bag = [[[1, 10**4], F32], [[10**5], "int64"], [[1], "int64"], [[1], "int64"]]
    assert node_work("aten._embedding_bag.default", [x, i, torch.empty(1, dtype=torch.long, device="meta")],
                     bag) >= 10**9
    y = torch.empty(4, 5, 6, device="meta")  # a None keeps its dimension whole; a mask counts at its size
    assert node_work("aten.index_put.default", [y, [None, torch.empty(3, dtype=torch.long, device="meta")], v],
                     [[[4, 5, 6], F32]]) == 2 * 120 + 3 + 1 + 4 * 3 * 6
    assert node_work("aten.index_put.default", [y, [torch.empty(4, 5, dtype=torch.bool, device="meta")], v],
                     [[[4, 5, 6], F32]]) == 2 * 120 + 20 + 1 + 20 * 6
