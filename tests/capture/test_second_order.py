"""Second-order steps from the open-world audit: code that differentiates a gradient inside its loss runs derivative
kernels as forward ops, and a snapshot of such a step used to carry no program ("needs --model"):

* MAML's inner loop (`torch.func.functional_call` + `autograd.grad(create_graph=True)`) on a CNN with
  cross-entropy: `nll_loss_backward` and `max_pool2d_with_indices_backward`;
* a physics-informed loss that takes one column of the input gradient (`du[:, :1]`, `du[:, 1]`) and differentiates
  it again (u_xx, u_tt): `select_backward` and `slice_backward`;
* a contractive autoencoder's Jacobian penalty (`vmap(jacrev(encoder))`): `squeeze_`, and `tanh_backward` with a
  batch of basis vectors as its gradient (it broadcasts against the saved output: the check refused the program).

Each trains guarded and unguarded (bitwise equal), then breaks at step 2; the snapshot is analyzed with no flags
where the training code cannot be imported. The checks these kernels get are in formats/derivchecks.py.
"""

from __future__ import annotations

from isolation import marker_line, program_ops, train_then_analyze

TRAINING = r'''
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, jacrev, vmap
from nanreplay import NanGuard


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU(),
                               nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Linear(36, 3)

    def forward(self, x):
        return self.head(self.f(x))


def maml_step(model, batch):
    xs, ys, xq, yq = batch
    params = dict(model.named_parameters())
    inner = F.cross_entropy(functional_call(model, params, (xs,)), ys)
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {k: p - 0.4 * g for (k, p), g in zip(params.items(), grads)}
    probs = functional_call(model, fast, (xq,)).softmax(-1)
    return -torch.log(probs.gather(1, yq[:, None])).mean()  # LINE: maml


class Pinn(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, xt):
        xt = xt.requires_grad_(True)
        du = torch.autograd.grad(self.net(xt).sum(), xt, create_graph=True)[0]
        u_xx = torch.autograd.grad(du[:, :1].sum(), xt, create_graph=True)[0][:, 0]
        u_tt = torch.autograd.grad(du[:, 1].sum(), xt, create_graph=True)[0][:, 1]
        res = (u_tt - 0.01 * u_xx)[:, None]  # a wave equation's residual
        return torch.log(res.pow(2).mean(-1)).mean()  # LINE: pinn


class Contractive(nn.Module):
    """A contractive autoencoder: the encoder's Jacobian (torch.func.jacrev under vmap) as a penalty."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 4)

    def forward(self, x):
        jac = vmap(jacrev(self.enc))(x)
        penalty = torch.log(jac.pow(2).sum((1, 2)))  # LINE: cae
        return F.mse_loss(self.dec(self.enc(x)), x) + 1e-3 * penalty.mean()


def run(kind, folder, guarded, bad):
    torch.manual_seed(0)
    model = {"maml": Conv, "pinn": Pinn, "cae": Contractive}[kind]()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, step_fn=maml_step, folder=folder) if guarded and kind == "maml" else \
        NanGuard(model, opt, folder=folder) if guarded else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(3):
        if kind == "maml":
            x, y = torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            if step == bad:
                with torch.no_grad():
                    model.head.weight.mul_(1e4)  # scaled weights: the query's softmax saturates to an exact 0
            batch = (x[:4], y[:4], x[4:], y[4:])
        else:
            batch = torch.rand(6, 2 if kind == "pinn" else 4, generator=g)
            if step == bad:
                batch[3] = 1e4  # tanh saturates: that point's residual (its Jacobian) is exactly 0
        if guard:
            guard.begin(batch, step=step)
        opt.zero_grad()
        loss = maml_step(model, batch) if kind == "maml" else model(batch.clone())
        if guard and not guard.loss_ok(loss):
            break
        loss.backward()
        if guard and not guard.grads_ok():
            break
        opt.step()
        losses.append(loss.detach().clone())
    return losses, model, guard


if __name__ == "__main__":
    for kind in sys.argv[2:]:
        plain, m0, _ = run(kind, f"{sys.argv[1]}/{kind}-off", False, None)
        guarded, m1, guard = run(kind, f"{sys.argv[1]}/{kind}-on", True, None)
        same = len(plain) == len(guarded) == 3 and all(torch.equal(a, b) for a, b in zip(plain, guarded)) and \
            all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters())) and guard.last_snapshot is None
        if not same:
            sys.exit(f"{kind}: the guarded run differs from the unguarded one")
        print(kind, run(kind, f"{sys.argv[1]}/{kind}", True, 2)[2].last_snapshot)
'''

ANALYZE = r'''
import json, sys
try:
    __import__("trainmod")
    raise SystemExit("the training code must not be importable here")
except ImportError:
    pass
from nanreplay.analysis import analyze
print(json.dumps({p: analyze(p, verify=False).to_json() for p in sys.argv[1:]}))
'''


def test_second_order_steps_record_and_localise(tmp_path):
    runs = train_then_analyze(tmp_path, TRAINING, ("maml", "pinn", "cae"), ANALYZE)
    want = {"maml": {"aten.nll_loss_backward.default", "aten.max_pool2d_with_indices_backward.default"},
            "pinn": {"aten.select_backward.default", "aten.slice_backward.default"},
            "cae": {"aten.squeeze_.dims", "aten.tanh_backward.default"}}
    for kind, (path, d) in runs.items():
        assert want[kind] <= program_ops(path), kind
        assert d["verdict"] == "culprit_found", (kind, d["verdict"], d.get("warnings"))
        c = d["culprit"]
        assert (c["forward_op"], c["source"]["file"].endswith("trainmod.py")) == ("aten.log.default", True), c
        assert c["source"]["line"] == marker_line(TRAINING, kind), (kind, c["source"])
        # MAML's query loss is the log of a gathered softmax: its exact form (the same gather of log_softmax) is named
        want_cause = "log_softmax" if kind == "maml" else "log_of_zero"
        assert d["diagnosis"]["cause"] == want_cause, (kind, d["diagnosis"]["cause"])
        assert not [w for w in d.get("warnings", []) if "error" in w], d["warnings"]
