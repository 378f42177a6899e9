"""Generated from one table: every op with a singular or overflowing domain is driven to its edge by a small
fixture (tests/domain_edges.py), and the analysis must name the op as the culprit, the cause (the op's own
rule, else the domain table's), and a fix that verifies by replay: finite, a no-op where the original was
fine, and a loss that does not move when its ε changes."""

from __future__ import annotations

import domain_edges
import pytest

from nanreplay import analysis
from nanreplay.diagnose.rules.domain import TABLE


def test_every_table_row_has_a_fixture():
    assert {p.split(".", 1)[1] for p in TABLE} <= set(domain_edges.EDGES)


@pytest.mark.parametrize("name", sorted(domain_edges.EDGES))
def test_each_edge_is_named_and_fixed(tmp_path, name):
    c = domain_edges.CASES[name]
    path = c.save(tmp_path / f"{name}.pt")
    d = analysis.analyze(path, model=c.model_spec).to_json()
    assert d["verdict"] == "culprit_found", d.get("verdict")
    # the line that calls the op: its row of the fixture table
    assert d["culprit"]["source"]["line"] == next(
        i for i, ln in enumerate(open(domain_edges.__file__), 1) if ln.lstrip().startswith(f'"{name}": (lambda'))
    diag = d["diagnosis"]
    assert diag["cause"] == c.expect["cause"], (diag["cause"], diag["title"])
    fix = diag["fix"]
    assert fix["verified"] is True, fix["verification"]
