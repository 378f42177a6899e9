"""A snapshot holding a tensor that is not dense (sparse COO, sparse CSR) anywhere — the batch, the weights,
the optimizer's state — is refused with one line, exit 2, nothing written. Before, the memory check that runs
before anything else asked such a tensor for its storage and the command died with a traceback. (`torch.load`
checks a sparse tensor's indices only on request: one whose index points a million rows past its size loads.)
The guard never writes one: a sparse momentum buffer (SGD on a sparse embedding's gradient) is stored dense
(tests/capture/test_open_world.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from crafting import assert_one_line_refusal, run_cli_cases, save, valid_snapshot


def _coo(rows_past: int = 0) -> torch.Tensor:
    i = torch.tensor([[0, 1 + rows_past], [0, 3]])
    return torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0]), (4, 4), check_invariants=False)


def _place(snap: dict, where: str, t: torch.Tensor) -> dict:
    d = dict(snap)
    if where == "batch":
        d["batch"] = {**d["batch"], "target": t}
    elif where == "state":
        d["state"] = {**d["state"], "fc.extra": t}
    else:
        d["optimizer"] = {"class": "SGD", "param_names": ["fc.weight"],
                          "state_dict": {"state": {0: {"momentum_buffer": t}}, "param_groups": [{"params": [0]}]}}
    return d


CASES = {
    "coo index past its size, in the batch": ("batch", lambda: _coo(10**6), "sparse_coo"),
    "coo in the weights": ("state", _coo, "sparse_coo"),
    "csr in the optimizer state": ("optimizer", lambda: _coo().to_sparse_csr(), "sparse_csr"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("crafted_layouts")
    _, snap = valid_snapshot(base)
    cases = []
    for i, (name, (where, make, _)) in enumerate(CASES.items()):
        folder = base / f"case{i}"
        folder.mkdir()
        p = save(_place(snap, where, make()), folder / "crafted.pt")
        cases.append({"name": name, "cwd": str(folder),
                      "args": ["analyze", str(p), "-o", str(folder / "r.html"), "--json", str(folder / "r.json")]})
    out = run_cli_cases(cases)
    return {c["name"]: {**out[c["name"]], "folder": Path(c["cwd"])} for c in cases}


@pytest.mark.parametrize("name", list(CASES))
def test_a_tensor_that_is_not_dense_is_refused_in_one_line(results, name):
    r = results[name]
    assert_one_line_refusal(r, "crafted.pt", f"holds a {CASES[name][2]} tensor", "dense tensors only")
    assert sorted(x.name for x in r["folder"].iterdir()) == ["crafted.pt"]
