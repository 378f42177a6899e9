"""A fix must be a no-op where the original was fine: a rewrite that changes the values the step computed
fine is not verified, however finite and plausible its loss.

A graph-attention softmax over each node's incoming edges, per head: the normaliser is a segment sum
(index_add over the edges' targets), the softmax runs over dim 0. One edge's score overflows exp. The
max-subtraction fix assumes the softmax is over dim -1 (its reasoning says so): it subtracts each edge's
maximum over the heads, which changes the attention weights of every healthy segment. Its replay is finite;
the no-op check, made where the rewritten expression ends (the division), rejects it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cases import Case
from nanreplay import analysis

DST = [0, 0, 1, 1, 1, 2, 2, 3]  # the target node of each of 8 edges


class GraphAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(4, 2)  # two heads
        with torch.no_grad():
            self.score.weight.abs_()  # positive weights: a large positive input is a large score in both heads

    def forward(self, x, v):
        dst = torch.tensor(DST)
        e = torch.exp(self.score(x))  # the line whose exp overflows
        denom = torch.zeros(4, 2).index_add(0, dst, e)
        alpha = e / denom[dst]
        return (alpha * v).sum()


def graph_attention():
    torch.manual_seed(0)
    return GraphAttention()


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    x[6] = 300.0  # an edge into node 2 whose scores are far above exp's range
    return {"x": (x, torch.randn(8, 2, generator=g))}


def test_a_rewrite_that_changes_healthy_values_is_not_verified(tmp_path):
    c = Case("graph_attention", __name__, "graph_attention", _batch)
    d = analysis.analyze(c.save(tmp_path / "gat.pt"), model=c.model_spec).to_json()
    assert d["verdict"] == "culprit_found" and d["culprit"]["op"] == "aten.exp.default", d["culprit"]
    fixes = [d["diagnosis"]["fix"], *d["diagnosis"]["candidates"]]
    maxsub = [f for f in fixes if f["kind"] == "max_subtraction"]
    assert maxsub, [f["kind"] for f in fixes]
    for f in maxsub:
        assert f["verified"] is False, f["verification"]
        assert "not a no-op" in f["verification"] and "changes values the original computed fine" in f["verification"]
    assert not any(f["verified"] for f in fixes if f["kind"] == "max_subtraction")
