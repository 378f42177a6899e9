"""The four scenarios analyzed on one process (every rank replayed here) and on 2 ranks (--nproc 2): the same
culprit, the same rank, the same cross-rank story."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from nanreplay.analysis import analyze
from nanreplay.cli import main

# scenario: (verdict, culprit op, forward op, phase, module, first rank, ranks reached through the reduce-scatter)
EXPECTED = {
    "a": ("culprit_found", "aten.log.default", "aten.log.default", "forward", "", 1, [0]),
    "b": ("culprit_found", "aten.sqrt.default", "aten.sqrt.default", "forward", "blocks.1", 0, []),
    "c": ("culprit_found", "aten.div.Tensor", "aten.sqrt.default", "backward", "dist", 0, [1]),
    "d": ("nonfinite_input", None, None, None, None, 1, [0]),
    "r": ("culprit_found", "aten.div.Tensor", "aten.sqrt.default", "backward", "dist", 0, [1]),  # DDP
}
STRATEGY = {"r": ("replicated", "c10d.all_reduce", "all-reduce")}


def check(a: dict, scenario: str, replay: str) -> None:
    verdict, op, fwd, phase, module, first, crossed = EXPECTED[scenario]
    d = a["distributed"]
    assert a["verdict"] == verdict
    strategy, op_name, words = STRATEGY.get(scenario, ("fsdp2", "c10d.reduce_scatter", "reduce-scatter"))
    assert d["replay"] == replay and d["world_size"] == 2 and d["strategy"] == strategy
    assert d["first_rank"] == first and d["crossed_to"] == crossed and d["crossed"] == bool(crossed)
    assert a["snapshot_info"]["rank"] == first and a["snapshot_info"]["format"] == "sharded"
    if op is not None:
        c = a["culprit"]
        assert (c["op"], c["forward_op"], c["phase"], c["module"], c["rank"]) == (op, fwd, phase, module, first)
        assert d["culprit_rank"] == first
        assert f"# CULPRIT ({'c' if scenario == 'r' else scenario})" in c["source"]["code"]  # the line it marks
        assert all(e["rank"] == first for e in a["chain"] if not e.get("collective"))
    rows = {r["rank"]: r for r in d["ranks"]}
    assert rows[first]["origin"] == "local"
    for r in crossed:  # a finite step of its own; non-finite only through the collective
        assert rows[r]["origin"] == "collective" and rows[r]["verdict"] == "not_reproduced"
        assert rows[r]["received"] and {g["op"] for g in rows[r]["received"]} == {op_name}
    colls = [g for g in d["collectives"] if g["crossed_to"]]
    assert bool(colls) == bool(crossed)
    assert all(g["from_ranks"] == [first] for g in colls)
    on_chain = [e for e in a["chain"] if e.get("collective")]
    if crossed and op is not None:  # the collective is an event on the chain, after the culprit rank's failure
        assert on_chain and on_chain[0]["op"] == op_name and on_chain[0]["to_ranks"] == [0, 1]
        assert on_chain[0]["parents"] == [max(e["index"] for e in a["chain"] if not e.get("collective"))]
    if crossed:
        assert f"Rank {crossed[0]} computed a finite step of its own" in d["explanation"]
        assert words in d["explanation"] and d["explanation"] in a["diagnosis"]["explanation"]


@pytest.mark.parametrize("scenario", ["a", "b", "c", "d", "r"])
def test_one_process(folder, scenario):
    a = analyze(folder(scenario)).to_json()
    check(a, scenario, "single_process")
    json.dumps(a, allow_nan=False)


def test_one_process_explains_each_case(folder):
    a = analyze(folder("b"), verify=False).to_json()
    assert "every one of ranks 0 and 1 produced it at the same op" in a["distributed"]["first_reason"]
    assert "Rank 1 went non-finite in its own step as well" in a["distributed"]["explanation"]
    c = analyze(folder("c"), verify=False).to_json()
    assert c["diagnosis"]["cause"] == "sqrt_at_zero"
    assert c["failure"]["what"] == "gradient" and c["loss"] is not None  # the loss stayed finite on every rank
    assert c["distributed"]["collectives"][0]["unit"] == "dist"
    d = analyze(folder("d"), verify=False).to_json()
    assert [(x["name"], x["rank"]) for x in d["nonfinite_leaves"]] == [("inputs", 1)]


def test_weights_already_non_finite(folder):
    a = analyze(folder("w"), verify=False).to_json()
    d = a["distributed"]
    assert a["verdict"] == "nonfinite_parameters" and a["nonfinite_leaves"][0]["name"] == "blocks.0.fc2.weight"
    gather = [g for g in d["collectives"] if g["op"] == "c10d.all_gather"]
    assert gather and gather[0]["from_ranks"] == [1] and gather[0]["to_ranks"] == [0, 1]
    assert gather[0]["unit"] == "blocks.0" and d["first_rank"] == 1 and a["nonfinite_leaves"][0]["shape"] == [8, 16]
    assert [(e["op"], e["phase"]) for e in a["chain"]] == [("c10d.all_gather", "forward")]  # an event on the chain too
    assert a["snapshot_info"]["rank"] == 1  # the rank whose shard holds it answers
    assert "in the shard of rank 1" in d["explanation"] and "all-gather" in d["explanation"]


@pytest.mark.parametrize("scenario", ["a", "b", "r"])
def test_two_ranks(folder, scenario):
    a = analyze(folder(scenario), nproc=2).to_json()
    check(a, scenario, "nproc")
    assert all(g["observed"] for g in a["distributed"]["collectives"])  # seen in the replay's own reduce-scatter
    assert any("fixes are not verified" in w for w in a["warnings"])


def test_two_ranks_from_the_command_line(folder, tmp_path):
    p = folder("c")
    out = tmp_path / "c.json"
    res = CliRunner().invoke(main, ["analyze", str(p), "--nproc", "2", "--json", str(out), "-o", str(tmp_path / "c.html")])
    assert res.exit_code == 0, res.output
    a = json.loads(out.read_text())
    check(a, "c", "nproc")
    assert "first non-finite: rank 0" in res.output and "reached rank 1 through c10d.reduce_scatter (dist)" in res.output
    assert (tmp_path / "c.html").read_text().count("reduce-scatter") >= 1
