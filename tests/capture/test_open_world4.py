"""Loops from the fourth open-world audit (docs/recordable-ops.md, "Training patterns audited (round 4)") that the
guard got wrong, in plain torch (the Lightning and DDP ones are in tests/integrations/test_manual_gan.py and
tests/distributed/test_ddp_zero.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard


def _both_losses(gan, batch):
    fake = gan["G"](batch[1])
    return (F.softplus(-gan["D"](batch[0])).mean() + F.softplus(gan["D"](fake.detach())).mean()
            + F.softplus(-gan["D"](fake)).mean())


def _gan_loop(folder, *, name_it: bool):
    """One guard over a GAN whose two optimizers each step after their own backward (optimizer=None)."""
    torch.manual_seed(0)
    gan = nn.ModuleDict({"G": nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6)),
                         "D": nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))})
    opt_g, opt_d = torch.optim.Adam(gan["G"].parameters(), lr=1e-3), torch.optim.Adam(gan["D"].parameters(), lr=1e-3)
    guard = NanGuard(gan, None, step_fn=_both_losses, folder=folder)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, z = torch.randn(4, 6, generator=g), torch.randn(4, 4, generator=g)
        guard.begin((x, z), step=step)
        fake = gan["G"](z)
        d_loss = F.softplus(-gan["D"](x)).mean() + F.softplus(gan["D"](fake.detach())).mean()
        opt_d.zero_grad()
        d_loss.backward()
        assert guard.grads_ok(optimizer=opt_d if name_it else None) or not name_it
        opt_d.step()
        opt_g.zero_grad()
        F.softplus(-gan["D"](fake)).mean().backward()
        assert guard.grads_ok(optimizer=opt_g if name_it else None) or not name_it
        opt_g.step()
    return guard


def test_one_guard_over_two_optimizers_checks_the_one_about_to_step(tmp_path):
    """At the discriminator's step the generator has no gradient yet (its loss comes next): not a dead gradient.
    Told which optimizer steps, the guard asks only its parameters; without it, every parameter of the model."""
    _gan_loop(tmp_path / "named", name_it=True)
    assert not (tmp_path / "named").exists() or not list((tmp_path / "named").iterdir())
    _gan_loop(tmp_path / "unnamed", name_it=False)
    assert [p.name.split("_")[2:4] for p in (tmp_path / "unnamed").glob("*.pt")] == [["no", "gradient"]]


class SparseGCN(nn.Module):
    """Two GCN layers over a normalised sparse COO adjacency given in the batch (`torch.sparse.mm`)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x, adj):
        x = x / x.norm(dim=-1, keepdim=True)  # a node with no features: 0/0
        return torch.sparse.mm(adj, self.l2(torch.relu(torch.sparse.mm(adj, self.l1(x)))))


def sparse_gcn():
    torch.manual_seed(0)
    return SparseGCN()


def _adjacency(g, n=8):
    ei = torch.randint(0, n, (2, 20), generator=g)
    ei = torch.cat([ei, ei.flip(0), torch.arange(n).repeat(2, 1)], 1)
    deg = torch.zeros(n).index_add_(0, ei[0], torch.ones(ei.shape[1]))
    return torch.sparse_coo_tensor(ei, deg[ei[0]].rsqrt() * deg[ei[1]].rsqrt(), (n, n)).coalesce()


def test_a_sparse_adjacency_in_the_batch_is_written_as_the_analysis_can_load_it(tmp_path):
    """The guard wrote the batch's sparse COO tensor as it was, and the analysis refused its own guard's file as
    "a crafted or foreign file" (a snapshot holds dense tensors only). It is now recorded dense, with a note; the
    step (`torch.sparse.mm`: not a program op) analyzes with --model, and names the division."""
    from nanreplay.analysis import analyze

    model = sparse_gcn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=tmp_path)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, adj, y = torch.randn(8, 6, generator=g), _adjacency(g), torch.randint(0, 3, (8,), generator=g)
        if step == 2:
            x[3] = 0
        guard.begin((x, adj), y, step=step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x, adj), y)
        if not guard.loss_ok(loss):
            break
        loss.backward()
        assert guard.grads_ok()
        opt.step()
    assert step == 2 and guard.last_snapshot
    snap = torch.load(guard.last_snapshot, weights_only=True)
    stored = snap["batch"]["inputs"][1]
    assert stored.layout is torch.strided and torch.equal(stored, adj.to_dense())
    assert any(n.startswith("sparse_coo tensors of the batch") for n in snap["notes"]), snap["notes"]
    d = analyze(guard.last_snapshot, model=f"{__name__}:sparse_gcn", trust=True, verify=False).to_json()
    assert d["verdict"] == "culprit_found" and d["culprit"]["forward_op"] == "aten.div.Tensor", d["verdict"]


def gcn_step(model, batch):
    """The adjacency normalised inside the step, as a sparse COO tensor: the step has no program."""
    x, ei, y = batch
    n = x.shape[0]
    deg = torch.zeros(n).index_add_(0, ei[0], torch.ones(ei.shape[1]))
    adj = torch.sparse_coo_tensor(ei, deg[ei[0]].rsqrt() * deg[ei[1]].rsqrt(), (n, n))
    return F.cross_entropy(model(x, adj), y)


def test_a_step_fn_snapshot_without_a_program_analyzes_with_model_and_its_step(tmp_path):
    """A step the recorder cannot write as a program (sparse ops here; a Python backward, QAT's fused observer) needs
    the model's code. For a loop that gave `step_fn` there was no way to give it: the snapshot's loss "cannot be
    rebuilt; pass --loss", and --loss took only a loss of (output, target). --loss MODULE:CALLABLE now names the
    step function of a step_fn snapshot, and --trust imports the one the snapshot names."""
    from nanreplay.analysis import analyze
    from nanreplay.errors import ModelError

    model = sparse_gcn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, step_fn=gcn_step, folder=tmp_path)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        ei = torch.randint(0, 8, (2, 20), generator=g)
        batch = (torch.randn(8, 6, generator=g), torch.cat([ei, ei.flip(0), torch.arange(8).repeat(2, 1)], 1),
                 torch.randint(0, 3, (8,), generator=g))
        if step == 2:
            batch[0][3] = 0
        guard.begin(batch, step=step)
        opt.zero_grad()
        loss = gcn_step(model, batch)
        if not guard.loss_ok(loss):
            break
        loss.backward()
        opt.step()
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap["step_program"] is None and "sparse" in snap["program_error"]
    for how in ({"loss": f"{__name__}:gcn_step"}, {"trust": True}):
        d = analyze(guard.last_snapshot, model=f"{__name__}:sparse_gcn", verify=False, **how).to_json()
        assert d["verdict"] == "culprit_found" and d["culprit"]["forward_op"] == "aten.div.Tensor", (how, d["verdict"])
    snap["loss_spec"]["spec"] = "__main__:gcn_step"  # a step function in the script that was run
    torch.save(snap, tmp_path / "script.pt")
    with pytest.raises(ModelError, match=r"__main__:gcn_step is the script that was run.*--loss MODULE:CALLABLE"):
        analyze(str(tmp_path / "script.pt"), model=f"{__name__}:sparse_gcn", trust=True, verify=False)
