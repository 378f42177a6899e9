"""What the analysis lets go of, and when: the optimizer state (Adam's moments, twice the weights) is read only by
the diagnosis of NaN/Inf weights and by update analyses; a step's replay never reads it, so the analysis drops it
before replaying, and every result is the same as with it held."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from nanreplay import NanGuard
from nanreplay.analysis import analyze, pipeline


class Pairs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(4, 4)

    def forward(self, a, b):
        return ((self.enc(a) - self.enc(b)) ** 2).sum(-1).sqrt()  # a duplicated pair: sqrt at 0, NaN gradient


def _adam_snapshot(folder) -> str:
    torch.manual_seed(0)
    model = Pairs()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            a = torch.randn(6, 4)
            b = a.clone() if step == 2 else torch.randn(6, 4)
            guard.begin((a, b), torch.ones(6), step=step)
            if not guard.step(F.mse_loss(model(a, b), torch.ones(6))):
                break
    assert guard.last_snapshot
    return guard.last_snapshot


def test_the_optimizer_state_is_dropped_before_the_replay_and_nothing_changes(tmp_path, monkeypatch):
    snap = _adam_snapshot(tmp_path)
    held: list[int] = []
    drop = pipeline.formats.base.Snapshot.drop_optimizer_state

    def count(self):  # the state's tensors the snapshot holds when the analysis would drop them
        held.append(sum(len(st) for st in self.raw["optimizer"]["state_dict"]["state"].values()))
        return 0

    monkeypatch.setattr(pipeline.formats.base.Snapshot, "drop_optimizer_state", count)
    with_state = analyze(snap).to_json()
    monkeypatch.setattr(pipeline.formats.base.Snapshot, "drop_optimizer_state", lambda self: held.append(drop(self)))
    without = analyze(snap).to_json()
    assert held[0] == 2 * 3 and held[1] > 0  # exp_avg, exp_avg_sq and step of both tensors, and their bytes freed
    for d in (with_state, without):
        d.pop("stats")
        for part in (d.get("differential") or {}).values():  # a differential's own timing, like stats
            part.pop("seconds", None)
    assert with_state == without
    assert without["verdict"] == "culprit_found" and without["snapshot_info"]["optimizer"]["class"] == "AdamW"


def test_progress_tells_each_pass_and_the_culprit_block_is_final_when_told(tmp_path):
    """`analyze(progress=...)`: the CLI prints the culprit block as soon as the replay has it; what it printed must
    be what the finished analysis says, so the block is taken at "culprit" and compared with the end."""
    from nanreplay import report
    from samples import SAMPLES

    told = []
    snap = str(SAMPLES / "sqrt_zero.pt")
    result = analyze(snap, progress=lambda stage, a: told.append((stage, report.culprit_block(a),
                                                                   bool(a.diagnosis))))
    assert [s for s, _, _ in told] == ["loaded", "culprit", "diagnosis", "precision"]
    block = told[1][1]
    assert told[1][2] is False and told[2][2] is True  # the block came before the diagnosis ran
    final = report.terminal_lines(result, "r.html")
    assert final[:len(block)] == block and len(final) > len(block) and "culprit" in block[1]
