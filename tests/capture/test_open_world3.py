"""Loops from the third open-world audit whose snapshots needed the training code (docs/recordable-ops.md,
"Training patterns audited (round 3)"):

* a module with full backward hooks (`register_full_backward_hook`, `register_full_backward_pre_hook`: gradient
  logging, Captum, Opacus-style per-module clipping). torch wraps such a module's inputs and outputs in an identity
  `autograd.Function`, which the recorder took for user code with a Python backward: "needs --model";
* a heterogeneous graph (torch_geometric's `to_hetero`), whose batch holds `edge_index_dict`, a dict keyed by
  `(src, relation, dst)` tuples: the guard wrote the snapshot, and the analysis refused it as "damaged" (a batch
  key must be a string).

Each loop trains guarded and unguarded (bitwise equal), then an all-zero row reaches an input normalisation
without ε at step 2; the snapshot is analyzed where the training code cannot be imported, and the fix it shows is
applied to a copy of the loop, which then trains on.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from isolation import ROOT, apply_and_train, framework, guard_invisible, marker_line, program_ops, train_then_analyze

from nanreplay.errors import SnapshotError
from nanreplay.formats import program as fprogram
from nanreplay.formats import schema

TRAINING = r'''
import json, sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from nanreplay import NanGuard


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.b.register_full_backward_hook(lambda m, gin, gout: (gin[0] * 0.5,))  # rescales what flows back
        self.head.register_full_backward_pre_hook(lambda m, gout: (gout[0].clamp(-1, 1),))

    def forward(self, x):
        x = x / x.norm(dim=-1, keepdim=True)  # LINE: hooks
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def hooks_batch(g, bad):
    x, y = torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)
    if bad:
        x[2] = 0  # an all-zero sample
    return x, y


def spread_batch(g, bad):
    x, y = torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)
    if bad:
        x[2] = x[0]  # a duplicated sample
    return x, y


def spread_step(model, batch):
    out = model(batch[0])
    spread = (out[0] - out[2]).pow(2).sum().sqrt()  # LINE: hooks_grad
    return F.cross_entropy(out, batch[1]) + 0.1 * spread


def hetero_model():
    from torch_geometric.nn import SAGEConv, to_hetero

    class GNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = SAGEConv((-1, -1), 8), SAGEConv((-1, -1), 3)

        def forward(self, x, edge_index):
            return self.c2(self.c1(x, edge_index).relu(), edge_index)

    meta = (["paper", "author"], [("author", "writes", "paper"), ("paper", "rev_writes", "author")])
    model = to_hetero(GNN(), meta, aggr="sum")
    g = torch.Generator().manual_seed(5)
    xd, ed, _ = hetero_batch(g, False)
    with torch.no_grad():
        model(xd, ed)  # the lazy input sizes
    return model


def hetero_batch(g, bad):
    xd = {"paper": torch.randn(10, 6, generator=g), "author": torch.randn(7, 4, generator=g)}
    src, dst = torch.randint(0, 7, (20,), generator=g), torch.randint(0, 10, (20,), generator=g)
    ed = {("author", "writes", "paper"): torch.stack([src, dst]), ("paper", "rev_writes", "author"): torch.stack([dst, src])}
    if bad:
        xd["paper"][3] = 0  # a paper with no features
    return xd, ed, torch.randint(0, 3, (10,), generator=g)


def hetero_step(model, batch):
    xd, ed, y = batch
    xd = {k: v / v.norm(dim=-1, keepdim=True) for k, v in xd.items()}  # LINE: hetero
    return F.cross_entropy(model(xd, ed)["paper"], y)


def hooks_step(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def run(kind, folder, guarded, bad, stop=True):
    torch.manual_seed(0)
    model = hetero_model() if kind == "hetero" else Hooked()
    step_fn, make = {"hooks": (hooks_step, hooks_batch), "hooks_grad": (spread_step, spread_batch),
                     "hetero": (hetero_step, hetero_batch)}[kind]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, step_fn=step_fn, folder=folder) if guarded else None
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(4):
        batch = make(g, step == bad)
        if guard:
            guard.begin(batch, step=step)
        opt.zero_grad()
        loss = step_fn(model, batch)
        if guard and not guard.loss_ok(loss) and stop:
            break
        loss.backward()
        if guard and not guard.grads_ok() and stop:
            break
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
        opt.step()
        rows.append((loss.item(), norm.item()))
    return rows, model, guard


if __name__ == "__main__":
    if sys.argv[1] == "--plain":
        print(json.dumps({sys.argv[2]: run(sys.argv[2], "unused", False, 2)[0]}))
        sys.exit()
    for kind in sys.argv[2:]:
        plain, m0, _ = run(kind, f"{sys.argv[1]}/{kind}-off", False, None)
        guarded, m1, guard = run(kind, f"{sys.argv[1]}/{kind}-on", True, None)
        same = len(plain) == 4 and plain == guarded and guard.last_snapshot is None and \
            all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters()))
        if not same:
            sys.exit(f"{kind}: the guarded run differs from the unguarded one")
        print(kind, run(kind, f"{sys.argv[1]}/{kind}", True, 2)[2].last_snapshot)
'''


def _check(tmp_path, kind, ops, culprit=("loss", "aten.div.Tensor", "forward")):
    runs = train_then_analyze(tmp_path, TRAINING, (kind,))
    path, d = runs[kind]
    snap = torch.load(path, weights_only=True)
    assert snap["program_error"] is None and snap["trigger"] == culprit[0]
    assert ops <= program_ops(path)
    assert d["verdict"] == "culprit_found", (d["verdict"], d.get("warnings"), d["diagnosis"]["explanation"])
    c = d["culprit"]
    assert (c["forward_op"], c["phase"]) == culprit[1:], c
    assert c["source"]["file"].endswith("trainmod.py") and c["source"]["line"] == marker_line(TRAINING, kind)
    fix = d["diagnosis"]["fix"]
    assert fix["verified"] is True, fix
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    apply_and_train(tmp_path / "fixed", TRAINING, "trainmod", kind, fix, bad=2, env=env)
    return snap


def test_a_module_with_full_backward_hooks_records_and_localises(tmp_path):
    _check(tmp_path, "hooks", {"aten.linalg_vector_norm.default", "aten.div.Tensor"})


def test_a_module_with_full_backward_hooks_replays_its_gradients(tmp_path):
    """The views torch makes for the hooks run under no_grad inside autograd; recorded as such, the replay cut the
    graph there: no parameter got a gradient, and a NaN gradient came out "not reproduced"."""
    _check(tmp_path, "hooks_grad", {"aten.sqrt.default"}, ("gradient", "aten.sqrt.default", "backward"))


def test_a_heterogeneous_graph_batch_keyed_by_edge_types_records_and_localises(tmp_path):
    framework("torch_geometric")
    snap = _check(tmp_path, "hetero", {"aten.div.Tensor", "aten.index_select.default"})
    edges = snap["batch"]["batch"][1]
    assert set(edges) == {("author", "writes", "paper"), ("paper", "rev_writes", "author")}
    leaves = json.loads(snap["step_program"])["leaves"]  # the edge indices are the batch's, by their tuple keys
    assert ["batch", 1, ["author", "writes", "paper"]] in [lf.get("path") for lf in leaves]


def _program(path) -> str:
    return json.dumps({"schema": fprogram.SCHEMA, "leaves": [{"ref": 0, "kind": "batch", "name": "x", "shape": [2],
                                                              "dtype": "float32", "path": path}],
                       "nodes": [], "loss": 0, "modules": [], "calls": [], "frames": []})


def test_a_program_names_a_tensor_under_a_tuple_key_and_nothing_else():
    assert fprogram.decode(_program(["batch", 1, ["author", "writes", "paper"]])).leaves[0].path == \
        ["batch", 1, ("author", "writes", "paper")]
    for bad in (["a", ["b"]], [], ["a"] * 9, ["a", True], [1.5]):
        with pytest.raises(SnapshotError, match="path must be a short list of keys"):
            fprogram.decode(_program(["batch", bad]))
    assert schema.batch_tree({("a", 1): torch.zeros(1)}, "batch").keys() == {("a", 1)}
    for key in (("a", ("b",)), (), ("a", None), ("a",) * 9):
        with pytest.raises(schema.SchemaError):
            schema.batch_tree({key: torch.zeros(1)}, "batch")


class _Unit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x / x.norm(dim=-1, keepdim=True))))


def test_cpu_fp16_autocast_with_a_grad_scaler_is_explained_in_the_loops_own_terms(tmp_path):
    """`torch.autocast("cpu", float16)` with `torch.amp.GradScaler("cpu")`: the healthy steps are the unguarded
    run's, the snapshot replays under the scaler's scale, and what the analysis says is in the loop's terms.
    Before, the fix's verification quoted the scaled loss (7.1e+04 for a loss of 1.09), and an all-zero row of
    the batch's first element was called 'the target'."""
    import torch.nn.functional as F

    from nanreplay import NanGuard
    from nanreplay.analysis import analyze
    from nanreplay.numbers import num

    def step_fn(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    def train(folder, guarded, bad):
        torch.manual_seed(0)
        model = _Unit()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu")
        guard = NanGuard(model, opt, step_fn=step_fn, scaler=scaler, folder=folder) if guarded else None
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(4):
            x, y = torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)
            if step == bad:
                x[2] = 0
            if guard:
                guard.begin((x, y), step=step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = step_fn(model, (x, y))
            if guard and not guard.loss_ok(loss):
                break
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if guard and not guard.grads_ok():
                break
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach().clone())
        return losses, model, guard

    assert guard_invisible(train, tmp_path, 4).last_snapshot is None
    _, _, guard = train(tmp_path / "bad", True, 2)
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap["autocast"]["dtype"] == "float16" and snap["grad_scale"] > 1
    d = analyze(guard.last_snapshot).to_json()
    assert d["culprit"]["forward_op"] == "aten.div.Tensor" and d["diagnosis"]["cause"] == "normalize_zero_norm"
    fix = d["diagnosis"]["fix"]
    assert fix["verified"] is True and 0.5 < fix["replay"]["loss"] < 3, fix["replay"]
    assert f"loss {num(fix['replay']['loss'])}," in fix["verification"], fix["verification"]
    assert "'batch[0]'" in d["diagnosis"]["explanation"] and "the target" not in d["diagnosis"]["explanation"]


def test_a_program_that_would_cut_a_gradient_path_is_refused_at_capture(tmp_path, monkeypatch):
    """Any op recorded with grad off that the step's own graph runs through (the hook views above were one) would
    leave parameters without a gradient in every replay: the guard now compares the program's paths with the
    step's graph and says which parameters it would cut, instead of writing a program that replays wrongly."""
    import warnings

    from nanreplay import NanGuard
    from nanreplay import torch_internals as ti

    monkeypatch.setattr(ti, "in_module_hook_function", lambda *a: False)  # the hook views recorded with grad off
    torch.manual_seed(0)
    model = _Unit()
    model.b.register_full_backward_hook(lambda m, gin, gout: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, loss_fn=torch.nn.functional.cross_entropy, folder=tmp_path)
    x, y = torch.randn(6, 6), torch.randint(0, 3, (6,))
    x[2] = 0
    guard.begin(x, y, step=0)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        assert not guard.loss_ok(torch.nn.functional.cross_entropy(model(x), y))
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert snap["step_program"] is None
    assert "would not give a.bias, a.weight, b.bias" in snap["program_error"], snap["program_error"]
    assert any("would not give" in str(w.message) for w in ws)


class _TwoInputs(torch.nn.Module):
    """A second, optional input (zeros where a sample lacks it) and a per-parameter gradient normalisation hook."""

    def __init__(self):
        super().__init__()
        self.a, self.extra, self.b = torch.nn.Linear(6, 16), torch.nn.Linear(2, 16), torch.nn.Linear(16, 3)
        self.extra.weight.register_hook(lambda g: g / g.norm())  # unit-norm gradients: 0 / 0 where g is all 0

    def forward(self, x, f):
        return self.b(torch.relu(self.a(x) + self.extra(f)))


def test_an_unreproduced_gradient_failure_names_the_steps_backward_hooks(tmp_path):
    """A hook that divides a gradient by its own norm makes NaN where the batch gives that parameter no gradient (a
    missing second input). The replay holds no Python and computes finite gradients; before, the analysis could
    only say the failure "depends on something the snapshot does not hold". The snapshot now notes the hooks the
    step ran, and the analysis names them as the likeliest source."""
    import torch.nn.functional as F

    from nanreplay import NanGuard
    from nanreplay.analysis import analyze

    torch.manual_seed(0)
    model = _TwoInputs()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=tmp_path)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, f, y = torch.randn(6, 6, generator=g), torch.randn(6, 2, generator=g), torch.randint(0, 3, (6,), generator=g)
        if step == 2:
            f = torch.zeros(6, 2)  # no sample of this batch has the second input
        guard.begin((x, f), y, step=step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x, f), y)
        assert guard.loss_ok(loss)
        loss.backward()
        if not guard.grads_ok():
            break
        opt.step()
    assert step == 2 and "_gradient_" in guard.last_snapshot
    snap = torch.load(guard.last_snapshot, weights_only=True)
    assert any("parameter 'extra.weight'" in n for n in snap["notes"]), snap["notes"]
    d = analyze(guard.last_snapshot, verify=False).to_json()
    diag = d["diagnosis"]
    assert (d["verdict"], diag["cause"]) == ("not_reproduced", "not_reproduced"), diag
    assert diag["title"] == "not reproduced without the step's backward hooks"
    assert "parameter 'extra.weight'" in diag["explanation"]
