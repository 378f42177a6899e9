"""What NanGuard writes for an FSDP2 model on 2 ranks: one folder, every rank's part, no pickle needed."""

from __future__ import annotations

import json

import pytest

from nanreplay import formats
from nanreplay.formats.program import decode


def test_every_rank_stops_at_the_same_step_and_names_the_same_folder(runs):
    for s, d in runs.items():
        assert {v["step"] for v in d["lines"].values()} == {2}, s
        assert all(v["error"] == "None" for v in d["lines"].values()), (s, d["lines"])


def test_the_folder_holds_every_rank_s_part(runs):
    folder = runs["a"]["folder"]
    names = {p.name for p in folder.iterdir()}
    assert {"nanreplay.json", "rank0.json", "rank1.json", "rank0.program.json", "rank1.program.json",
            "__0_0.distcp", "__1_0.distcp", ".metadata"} <= names
    c = json.loads((folder / "nanreplay.json").read_text())
    assert c["format"] == "nanreplay.sharded" and c["world_size"] == 2 and c["strategy"] == "fsdp2"
    assert c["units"] == ["", "dist", "blocks.0", "blocks.1"]
    assert c["unit_parameters"]["blocks.1"] == ["blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.fc1.weight",
                                                "blocks.1.fc1.bias", "blocks.1.fc2.weight", "blocks.1.fc2.bias"]
    assert c["mesh"]["shape"] == [2] and c["trigger"] == "loss" and c["step"] == 2
    # each weight is stored as two row shards, one per rank's file: the whole model is never gathered to write it
    w = c["tensors"]["model/blocks.0.fc1.weight"]
    assert w["shape"] == [16, 8] and [ch["sizes"] for ch in w["chunks"]] == [[8, 8], [8, 8]]
    assert sorted(ch["file"] for ch in w["chunks"]) == ["__0_0.distcp", "__1_0.distcp"]
    m = c["tensors"]["optim/state/blocks.0.fc1.weight/momentum_buffer"]  # the optimizer state, sharded the same way
    assert m["shape"] == [16, 8] and len(m["chunks"]) == 2
    assert c["optimizer"]["class"] == "SGD" and c["optimizer"]["param_groups"][0]["lr"] == 1e-3
    assert {"rank0/batch/0", "rank1/batch/0"} <= set(c["tensors"])


@pytest.mark.parametrize("scenario, trigger, ranks", [("a", "loss", [1]), ("b", "loss", [0, 1]),
                                                      ("c", "gradient", [0, 1]), ("d", "loss", [1])])
def test_which_ranks_saw_it(runs, scenario, trigger, ranks):
    snap = formats.load(runs[scenario]["folder"])
    assert snap.format == "sharded" and snap.trigger == trigger
    assert snap.raw["contents"]["nonfinite_ranks"] == ranks


def test_each_rank_recorded_its_own_step_over_the_whole_weights(runs):
    folder = runs["c"]["folder"]
    for r in (0, 1):
        prog = decode((folder / f"rank{r}.program.json").read_text())
        params = {lf.name: lf.shape for lf in prog.leaves if lf.kind == "param"}
        assert params["blocks.0.fc1.weight"] == [16, 8]  # whole, not the [8, 8] shard
        ops = {n.name for n in prog.nodes}
        assert not any(op.startswith(("c10d", "_c10d", "fsdp")) for op in ops)  # no collective in a program
        assert "aten.sqrt.default" in ops
    part = json.loads((folder / "rank0.json").read_text())
    assert part["rank"] == 0 and part["program"] == "rank0.program.json"
    assert part["batch"]["inputs"] == {"tensor": "rank0/batch/0"}
