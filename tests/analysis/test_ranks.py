"""Merging ranks (analysis/ranks.py): pure functions of per-rank summaries, no processes."""

from __future__ import annotations

from nanreplay.analysis.ranks import RankResult, collectives, culprit_key, first_rank, merge, receivers

CONTENTS = {"world_size": 2, "strategy": "fsdp2", "nonfinite_ranks": [0, 1],
            "unit_parameters": {"": ["head.weight"], "blocks.0": ["blocks.0.w"]},
            "tensors": {"model/head.weight": {"shape": [4, 3]}, "model/blocks.0.w": {"shape": [4]}}}


def culprit(rank: int, phase: str, fwd: int, event: int, op: str = "aten.log.default", module: str = "blocks.0") -> RankResult:
    return RankResult(rank, "culprit_found", culprit={"op": op, "phase": phase, "module": module, "kind": "nan"},
                      key=culprit_key({"phase": phase, "fwd": fwd, "event": event}))


def test_a_non_finite_batch_is_first_then_the_earliest_op_in_the_step():
    res = {0: culprit(0, "forward", 5, 1), 1: RankResult(1, "nonfinite_input", leaves=[{"name": "inputs"}])}
    first, why = first_rank(res)
    assert first.rank == 1 and "before any op ran" in why
    res = {0: culprit(0, "backward", 9, 0), 1: culprit(1, "forward", 30, 4)}
    assert first_rank(res)[0].rank == 1  # forward comes before backward
    res = {0: culprit(0, "backward", 3, 0), 1: culprit(1, "backward", 9, 0)}
    assert first_rank(res)[0].rank == 1  # backward runs the later forward op's gradient first
    res = {0: culprit(0, "forward", 4, 2), 1: culprit(1, "forward", 4, 2)}
    first, why = first_rank(res)
    assert first.rank == 0 and "every one of ranks 0 and 1" in why
    assert first_rank({0: RankResult(0, "not_reproduced")})[0] is None


def test_the_reduce_scatter_reaches_the_ranks_whose_rows_are_bad():
    sender = {0: {"kind": "nan", "nan": 3, "inf": 0, "rows": [3]}}
    res = {0: RankResult(0, "culprit_found"), 1: RankResult(1, "not_reproduced")}
    assert receivers(CONTENTS, "head.weight", sender, res) == [1]  # row 3 of 4 lies in rank 1's half
    assert receivers(CONTENTS, "head.weight", {0: {**sender[0], "rows": [0, 1]}}, res) == [0]
    assert receivers(CONTENTS, "head.weight", {0: {**sender[0], "rows": None}}, res) == [0, 1]
    assert receivers({**CONTENTS, "strategy": "replicated"}, "head.weight", sender, res) == [0, 1]  # all-reduce
    seen = {0: RankResult(0, "culprit_found", reduced_bad={}), 1: RankResult(1, "x", reduced_bad={"head.weight": "nan"})}
    assert receivers(CONTENTS, "head.weight", sender, seen) == [1]  # what the N-rank replay observed wins


def test_merge_names_the_crossing_and_not_the_ranks_that_made_their_own():
    res = {0: culprit(0, "forward", 2, 0), 1: RankResult(1, "not_reproduced")}
    res[0].bad_grads = {"head.weight": {"kind": "nan", "nan": 12, "inf": 0, "rows": None},
                        "blocks.0.w": {"kind": "nan", "nan": 4, "inf": 0, "rows": None}}
    block = merge(CONTENTS, res, replay="single_process", nproc=1)
    assert block["first_rank"] == block["culprit_rank"] == 0 and block["crossed_to"] == [1]
    assert sorted(g["unit"] for g in collectives(CONTENTS, res)) == ["", "blocks.0"]
    assert "Rank 1 computed a finite step of its own" in block["explanation"]
    assert "reduce-scatter of the root unit, blocks.0" in block["explanation"]
    assert [r["origin"] for r in block["ranks"]] == ["local", "collective"]
    res[1] = culprit(1, "forward", 2, 0)
    res[1].bad_grads = dict(res[0].bad_grads)
    block = merge(CONTENTS, res, replay="single_process", nproc=1)
    assert block["crossed_to"] == [] and block["crossed"] is False  # each rank made its own
    assert "Rank 1 went non-finite in its own step as well" in block["explanation"]


def test_nothing_reproduced():
    block = merge(CONTENTS, {0: RankResult(0, "not_reproduced"), 1: RankResult(1, "not_reproduced")},
                  replay="nproc", nproc=2)
    assert block["first_rank"] is None and block["collectives"] == []
    assert "did not reproduce" in block["explanation"]


def test_round_trip_as_json():
    r = culprit(1, "backward", 3, 7)
    r.bad_grads = {"w": {"kind": "inf", "nan": 0, "inf": 2, "rows": [0]}}
    assert RankResult.from_json(r.to_json()) == r
