"""Issue 36: loops on real library code whose steps run the ops real models emit (torch_geometric's scatter softmax,
torch.stft's FFT, torch.distributions' argument validation), trained under NanGuard in one folder and analyzed with
no flags in another, where the training code is not importable: the snapshot carries its step program, and the
culprit op and line are the ones a user would change.

* a PyG GAT whose input normalisation divides a featureless node by its zero norm (0/0 flows through
  scatter_reduce_ and the attention softmax);
* an STFT / log-power front-end fed a silent clip: log of a zero power bin;
* a Normal policy (validate_args on) whose log-std runs away: exp overflows, the validation accepts an infinite
  scale, log_prob is not finite.
"""

from __future__ import annotations

import pytest
import torch
from isolation import marker_line, program_ops, train_then_analyze

from nanreplay import NanGuard

TRAINING = r'''
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Normal
from nanreplay import NanGuard


class GAT(nn.Module):
    def __init__(self, d=8, hidden=8, classes=3):
        super().__init__()
        from torch_geometric.nn import GATConv
        self.conv1, self.conv2 = GATConv(d, hidden, heads=2), GATConv(2 * hidden, classes)

    def forward(self, x, edge_index):
        x = x / x.norm(dim=-1, keepdim=True)  # LINE: gat
        return self.conv2(F.elu(self.conv1(x, edge_index)), edge_index)


class LogMel(nn.Module):
    """An on-device STFT / log-power front-end, Whisper-style, and a linear classifier."""

    def __init__(self, n_fft=32, hop=8, classes=4):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft))
        self.mel = nn.Linear(n_fft // 2 + 1, 8, bias=False)
        self.head = nn.Linear(8, classes)

    def forward(self, wave):
        spec = torch.stft(wave, self.n_fft, self.hop, window=self.window, return_complex=True)
        power = spec.abs() ** 2
        logp = torch.log(power)  # LINE: stft
        return self.head(self.mel(logp.transpose(1, 2)).mean(1))


class Policy(nn.Module):
    def __init__(self, obs=4, act=2):
        super().__init__()
        self.body = nn.Linear(obs, 16)
        self.mu, self.log_std = nn.Linear(16, act), nn.Linear(16, act)

    def forward(self, obs):
        h = torch.tanh(self.body(obs))
        std = self.log_std(h).exp()  # LINE: policy
        return self.mu(h), std


def gat(folder):
    torch.manual_seed(0)
    model = GAT()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=folder)
    g = torch.Generator().manual_seed(0)
    edge_index = torch.randint(0, 12, (2, 40), generator=g)
    for step in range(5):
        x = torch.randn(12, 8, generator=g)
        if step == 3:
            x[5] = 0.0  # a node with no features
        y = torch.randint(0, 3, (12,), generator=g)
        guard.begin((x, edge_index), y, step=step)
        opt.zero_grad()
        if not guard.step(F.cross_entropy(model(x, edge_index), y)):
            break
    return guard.last_snapshot


def stft(folder):
    torch.manual_seed(0)
    model = LogMel()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.cross_entropy, folder=folder)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        wave = torch.randn(2, 256, generator=g)
        if step == 2:
            wave[1] = 0.0  # a silent clip: its power bins are exactly zero
        y = torch.randint(0, 4, (2,), generator=g)
        guard.begin(wave, y, step=step)
        opt.zero_grad()
        if not guard.step(F.cross_entropy(model(wave), y)):
            break
    return guard.last_snapshot


def policy(folder):
    torch.manual_seed(0)
    model = Policy()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def nll(out, actions):
        mu, std = out
        return -Normal(mu, std, validate_args=True).log_prob(actions).mean()

    guard = NanGuard(model, opt, loss_fn=nll, folder=folder)
    g = torch.Generator().manual_seed(2)
    for step in range(5):
        obs, actions = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        if step == 3:
            with torch.no_grad():
                model.log_std.bias.fill_(100.0)  # a runaway log-std: exp overflows
        guard.begin(obs, actions, step=step)
        opt.zero_grad()
        if not guard.step(nll(model(obs), actions)):
            break
    return guard.last_snapshot


if __name__ == "__main__":
    for kind in sys.argv[2:]:
        print(kind, {"gat": gat, "stft": stft, "policy": policy}[kind](f"{sys.argv[1]}/{kind}"))
'''


KINDS = ("gat", "stft", "policy")


def _line(marker: str) -> int:
    return marker_line(TRAINING, marker)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("torch_geometric")
    return train_then_analyze(tmp_path_factory.mktemp("library_ops"), TRAINING, KINDS)



def test_gat_zero_norm_node_is_found_through_the_scatter_softmax(runs):
    path, d = runs["gat"]
    assert {"aten.scatter_reduce_.two", "aten.scatter_add_.default"} <= program_ops(path)
    c = d["culprit"]
    assert d["verdict"] == "culprit_found" and c["op"] == "aten.div.Tensor" and c["phase"] == "forward"
    assert c["source"]["line"] == _line("gat") and c["source"]["file"].endswith("trainmod.py")
    assert d["diagnosis"]["fix"]["kind"] == "epsilon"


def test_stft_front_end_log_of_a_silent_clip(runs):
    path, d = runs["stft"]
    assert "aten._fft_r2c.default" in program_ops(path)
    c = d["culprit"]
    assert d["verdict"] == "culprit_found" and c["op"] == "aten.log.default" and c["source"]["line"] == _line("stft")
    assert d["diagnosis"]["cause"] == "log_of_zero"


def test_distributions_policy_with_validation_on(runs):
    path, d = runs["policy"]
    assert "aten._is_all_true.default" in program_ops(path)  # the validation, recorded as the pure reduction it is
    c = d["culprit"]
    assert d["verdict"] == "culprit_found" and c["op"] == "aten.exp.default" and c["source"]["line"] == _line("policy")


class _FreesItsInput(torch.nn.Module):
    """What torch_geometric's GroupAddRev does to save memory: the input's storage is freed inside the step."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        out = torch.log(self.lin(x.clone()) - 100.0)  # NaN: the step fails
        x.untyped_storage().resize_(0)
        return out.mean()


def test_a_batch_freed_by_the_step_is_one_warning_not_a_segfault(tmp_path):
    """Copying a batch tensor whose storage the step freed read past the storage (a segfault inside the user's
    training); the guard now says why it cannot write the snapshot, once, and training goes on."""
    model = _FreesItsInput()
    guard = NanGuard(model, folder=tmp_path)
    x = torch.randn(3, 4)
    guard.begin(x)
    with pytest.warns(RuntimeWarning, match="no longer holds its data"):
        ok = guard.loss_ok(model(x))
    assert not ok and guard.last_snapshot is None and list(tmp_path.iterdir()) == []


class _StandardizingPolicy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.mu = torch.nn.Linear(4, 16), torch.nn.Linear(16, 2)
        self.log_std = torch.nn.Parameter(torch.zeros(2))

    def forward(self, obs):
        z = (obs - obs.mean(0)) / obs.std(0)  # a constant observation column: 0/0
        return self.mu(torch.tanh(self.body(z))), self.log_std.exp().expand(obs.shape[0], 2)


def _policy_nll(out, actions):
    mu, std = out
    return -torch.distributions.Normal(mu, std, validate_args=True).log_prob(actions).mean()


def test_a_nan_the_validation_would_reject_gets_a_culprit_not_a_crash(tmp_path):
    """torch.distributions' validation is a pure `_is_all_true` in the program (its `raise` is Python the program
    does not hold): a batch whose NaN the validation would reject in eager (ValueError) replays to a culprit."""
    from nanreplay.analysis import analyze

    torch.manual_seed(0)
    model = _StandardizingPolicy()
    guard = NanGuard(model, loss_fn=_policy_nll, folder=tmp_path)
    obs, actions = torch.randn(8, 4), torch.randn(8, 2)
    guard.begin(obs, actions)
    _policy_nll(model(obs), actions)
    d = guard.to_dict("loss")
    guard.close()
    assert d["step_program"] is not None, d.get("program_error")
    bad = obs.clone()
    bad[:, 2] = 0.5  # a sensor stuck at one value: finite, but its standard deviation is 0
    with pytest.raises(ValueError, match="constraint"):
        _policy_nll(model(bad), actions)  # eager: the validation rejects the NaN loc
    d["batch"]["inputs"] = bad
    path = tmp_path / "stuck_sensor.pt"
    torch.save(d, path)
    r = analyze(str(path)).to_json()
    c = r["culprit"]
    assert r["verdict"] == "culprit_found" and c["op"] == "aten.div.Tensor", (r["verdict"], c)
    assert "obs.std(0)" in c["source"]["code"]
