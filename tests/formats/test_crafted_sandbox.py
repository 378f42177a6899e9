"""Crafted files aimed at the sandbox's own assumptions (issue 37), analyzed by `nanreplay analyze` in a child
interpreter (tests/crafting.py): a kernel that crashes fails its case, never pytest. Each is refused with one
line and exit 2 before its kernel runs, nothing written.

Families: two batch leaves that are one tensor, with an in-place view change through one (the dry run must
see it in both: native_batch_norm would otherwise write past 1-element running statistics); statistics of the
wrong length; upsample with a NaN scale; `_grouped_mm` offsets that leave rows uninitialised; one node whose
work is astronomically large (refused at once by the dry run's cost bound, from the default --timeout); a
kernel's own copy of an expanded view counted against --max-memory.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from crafting import BASE_REF, ROOT, R, assert_one_line_refusal, run_cli_cases, save, valid_snapshot, with_nodes

from nanreplay import NanGuard

F32 = "float32"
BN_STATS = {"w": torch.ones(1), "b": torch.zeros(1), "rm": torch.zeros(1), "rv": torch.ones(1)}


def _nan_scale(d: dict) -> dict:
    d = with_nodes(d, {"x": torch.randn(1, 1, 2, 2)}, [
        ("aten.upsample_nearest2d.default", [R("x"), [4, 4], 0.5, 2.0], {}, [[[1, 1, 4, 4], F32]])])
    prog = json.loads(d["step_program"])
    prog["nodes"][0]["args"][2] = {"f": "nan"}  # the program's encoding of a non-finite float literal
    d["step_program"] = json.dumps(prog)
    return d


def aliased_batch_norm(d: dict) -> dict:
    """batch['target'] named by two leaves (one object after torch.load); transpose_ through the first makes the
    second [4, 64, 1, 9]; native_batch_norm then reads it with 1-channel statistics."""
    d = with_nodes(d, BN_STATS, [])
    prog = json.loads(d["step_program"])
    d["batch"]["target"] = torch.randn(4, 1, 64, 9)
    a, b = BASE_REF + 100, BASE_REF + 101
    for ref in (a, b):
        prog["leaves"].append({"ref": ref, "kind": "batch", "name": "target", "shape": [4, 1, 64, 9], "dtype": F32,
                               "path": ["target"]})
    stats = [{"r": BASE_REF + i} for i in range(4)]
    prog["nodes"][:0] = [
        {"op": "aten.transpose_.default", "args": [{"r": a}, 1, 2], "out": BASE_REF + 200,
         "meta": [[[4, 64, 1, 9], F32]]},
        {"op": "aten.native_batch_norm.default", "args": [{"r": b}, *stats, True, 0.1, 1e-5],
         "out": [BASE_REF + 201, BASE_REF + 202, BASE_REF + 203],
         "meta": [[[4, 1, 64, 9], F32], [[1], F32], [[1], F32]]},
    ]
    d["step_program"] = json.dumps(prog)
    return d


# name -> (build(d) -> d, words of the refusal)
CASES = {
    "aliased leaves + transpose_ + native_batch_norm (heap write)": (aliased_batch_norm, ("invalid step program",)),
    "native_batch_norm with 1-element stats on 64 channels": (
        lambda d: with_nodes(d, {"x": torch.randn(4, 64, 1, 9), **BN_STATS}, [
            ("aten.native_batch_norm.default", [R("x"), R("w"), R("b"), R("rm"), R("rv"), True, 0.1, 1e-5], {},
             [[[4, 64, 1, 9], F32], [[64], F32], [[64], F32]])]), ("per channel",)),
    "upsample_nearest2d with a NaN scale (SIGSEGV)": (_nan_scale, ("finite and positive",)),
    "_grouped_mm offsets short of the rows (uninitialised memory)": (
        lambda d: with_nodes(d, {"a": torch.randn(6, 4), "b": torch.randn(2, 4, 4),
                                 "o": torch.tensor([2, 4], dtype=torch.int32)}, [
            ("aten._grouped_mm.default", [R("a"), R("b"), R("o")], {}, [[[6, 4], F32]])]), ("uninitialised",)),
    "one node of 2**58 additions (runs for years)": (
        lambda d: with_nodes(d, {"x": torch.ones(1, 1)}, [
            ("aten.expand.default", [R("x"), [2**29, 2**29]], {}, [[[2**29, 2**29], F32]]),
            ("aten.sum.default", [R(0)], {}, [[[], F32]])]), ("element operations", "--timeout")),
    "mm of a 1 GiB expanded view under --max-memory 512M (the kernel's own copy)": (
        lambda d: with_nodes(d, {"x": torch.ones(1, 1), "y": torch.ones(2**14, 1)}, [
            ("aten.expand.default", [R("x"), [2**14, 2**14]], {}, [[[2**14, 2**14], F32]]),
            ("aten.mm.default", [R(0), R("y")], {}, [[[2**14, 1], F32]])]), ("--max-memory",)),
}
EXTRA = {"mm of a 1 GiB expanded view under --max-memory 512M (the kernel's own copy)": ["--max-memory", "512M"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sandbox")
    cases = []
    for i, (name, (build, _)) in enumerate(CASES.items()):
        _, d = valid_snapshot(folder / f"v{i}")
        path = save(build(d), folder / f"c{i}.pt")
        cases.append({"name": name, "cwd": str(folder), "args": ["analyze", str(path), "--json",
                                                                  str(folder / f"c{i}.json"), *EXTRA.get(name, [])]})
    return folder, run_cli_cases(cases)


@pytest.mark.parametrize("name", list(CASES))
def test_a_crafted_file_aimed_at_the_sandbox_is_refused_before_its_kernel(results, name):
    folder, got = results
    assert_one_line_refusal(got[name], *CASES[name][1])
    assert not list(folder.glob("c*.json"))


_SAFETY_NET = r'''
import sys, torch
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from nanreplay.errors import SnapshotError
from nanreplay.formats import native
from nanreplay.formats import load
native.same_objects = lambda leaves: {}  # the dry run as it was: each leaf its own meta tensor
snap = load(sys.argv[2])
dev = torch.device("cpu")
subject = native.program_subject(snap, dev, None, native.replay_options(snap.raw, dev))
try:
    subject.model(subject.inputs, subject.target)
except SnapshotError as e:
    print("refused:", e)
'''


def test_the_replay_refuses_shapes_the_dry_run_did_not_check(tmp_path):
    """The safety net behind the dry run's aliasing model: with that model switched off, the replay still refuses
    native_batch_norm before its kernel, because its input is not the shape the dry run checked."""
    _, d = valid_snapshot(tmp_path)
    path = save(aliased_batch_norm(d), tmp_path / "alias.pt")
    res = subprocess.run([sys.executable, "-c", _SAFETY_NET, str(ROOT / "tests"), str(path)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "refused:" in res.stdout and "in the dry run that checked them" in res.stdout, res.stdout


def test_a_nodes_work_counts_expanded_views_at_full_size_and_products_by_their_multiply_adds():
    from nanreplay.formats.dryrun import node_work

    n = 2**15
    x = torch.empty(1, 1, device="meta").expand(n, n)  # 1 element stored, n*n visited
    out = [[[n, n], F32]]
    assert node_work("aten.neg.default", [x], out) == 2 * n * n
    assert node_work("aten.mm.default", [x, x], out) == 3 * n * n + n**3
    assert node_work("aten.einsum.default", ["ij,jk->ik", [x, x]], out) == 3 * n * n + n**3
    w = torch.empty(8, 4, 3, 3, device="meta")
    img = torch.empty(2, 4, 16, 16, device="meta")
    conv = node_work("aten.convolution.default", [img, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1],
                     [[[2, 8, 16, 16], F32]])
    assert conv >= 2 * 8 * 16 * 16 * 4 * 3 * 3  # every output element: in_channels * kernel multiply-adds


class _LogLSTM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(4, 8)

    def forward(self, x):
        return torch.log(torch.relu(self.rnn(x)[0]) - 1).mean()


def test_a_later_node_reads_the_rnn_workspace_as_zeros_and_backward_still_runs(tmp_path, monkeypatch):
    """oneDNN's workspace (mkldnn_rnn_layer's fourth output) is memory the kernel fills only where it needs: a node
    that reads it would see what was there before. The replay binds zeros for it; backward keeps the real one."""
    from nanreplay.formats import load, native
    from nanreplay.formats.stepmodel import StepModule

    torch.manual_seed(0)
    model = _LogLSTM()
    guard = NanGuard(model, folder=tmp_path / "lstm")
    x = torch.randn(5, 2, 4)
    guard.begin(x)
    assert not guard.loss_ok(model(x))
    path = guard.last_snapshot
    seen = []
    bind = StepModule._bind

    def spy(self, node, out, env, i):
        bind(self, node, out, env, i)
        if node.name == "aten.mkldnn_rnn_layer.default":
            seen.append(env[node.out[3]])
    monkeypatch.setattr(StepModule, "_bind", spy)
    snap = load(path)
    dev = torch.device("cpu")
    subject = native.program_subject(snap, dev, None, native.replay_options(snap.raw, dev))
    loss = subject.model(subject.inputs, subject.target)
    loss.backward()  # the real workspace: the LSTM's gradients are computed
    assert seen and seen[0].numel() > 0 and not seen[0].any()
    assert not torch.isfinite(loss)  # the recorded failure replays as before
    assert all(p.grad is not None for p in subject.model.parameters() if p.requires_grad)
