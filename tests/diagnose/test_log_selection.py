"""The log of a *selection* of a softmax / sigmoid (diagnose/edits/selfix.py): `-torch.log(probs.gather(1, a))`,
`torch.log(probs[range(n), y])`, `(softmax(x) * F.one_hot(y, C)).sum(-1)` under a log, `p = sigmoid(z)` then
`log(p.gather(...))`. The exact form is the same selection of log_softmax / logsigmoid. Each loop is analyzed where
its training code cannot be imported, and the fix shown is applied to a copy of the file and trained on
(isolation.apply_and_train: every step finite, the healthy steps' loss and gradient norm unchanged):

* a policy gradient whose probabilities are also sampled from (Categorical) and whose entropy is a bonus: the
  softmax line keeps `probs` for them and adds `log_probs`;
* a pointer network whose forward returns F.softmax over the input positions, the loss indexing it: crossline;
* the one-hot product-sum on one line; a sigmoid, gathered, logged (logsigmoid);
* a GPT-2 in a Hugging Face Trainer subclass whose compute_loss takes `-torch.log(probs.gather(...))` of a tempered
  softmax made on the line above;
* and an unlikelihood loss, `log(1 - probs.gather(...))`: computed from the probabilities, not a selection of
  them: the rule must not fire.
"""

from __future__ import annotations

import pytest
from isolation import ROOT, apply_and_train, framework, marker_line, train_and_analyze_isolated

TRAINING = r'''
import contextlib
import json
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical
from nanreplay import NanGuard


class Net(nn.Module):
    def __init__(self, n_out=3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, n_out))

    def forward(self, obs):
        return self.net(obs)


def pg_loss(logits, target):
    actions, adv, explore = target
    probs = torch.softmax(logits / 0.5, -1)  # LINE: pg probs
    dist = Categorical(probs=probs)
    taken = torch.where(explore, actions, dist.sample())  # epsilon-greedy: some actions are not the policy's
    bonus = dist.entropy().mean()
    return -(torch.log(probs.gather(1, taken[:, None])).squeeze(1) * adv).mean() - 0.01 * bonus  # LINE: pg log


class Pointer(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.query = nn.Linear(8, 8)

    def forward(self, x):
        h = self.enc(x)
        scores = (self.query(h.mean(1))[:, None, :] * h).sum(-1)
        return F.softmax(scores, -1)  # LINE: ptr softmax


def pointer_loss(probs, y):
    return -torch.log(probs[torch.arange(len(y)), y]).mean()  # LINE: ptr log


def pointer_entropy_loss(probs, y):  # the forward's probabilities are read twice: the forward must stay a softmax
    entropy = -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean()
    return -torch.log(probs[torch.arange(len(y)), y]).mean() - 0.01 * entropy  # LINE: ptr entropy


def onehot_loss(logits, y):
    return -torch.log((torch.softmax(logits, -1) * F.one_hot(y, 5)).sum(-1)).mean()  # LINE: onehot


def tag_loss(logits, y):
    p = torch.sigmoid(logits)  # LINE: sig p
    return -torch.log(p.gather(1, y[:, None])).mean()  # LINE: sig log


def unlikelihood(logits, y):
    probs = torch.softmax(logits, -1)
    return -torch.log(1 - probs.gather(1, y[:, None])).mean()  # LINE: unlike


def eps_loss(logits, y):  # float16: the user's 1e-8 rounds to 0 in it
    policy = torch.softmax(logits, -1)
    return -torch.log(policy.gather(1, y[:, None]) + 1e-8).mean()  # LINE: eps


def batches(kind, step, model):
    g = torch.Generator().manual_seed(step)
    if kind.startswith("ptr"):
        x = torch.randn(4, 6, 4, generator=g)
        y = torch.randint(0, 6, (4,), generator=g)
        if step == 2:
            x[1] *= 300.0  # an outlier set: the scores are quadratic in it, the target position gets exactly 0
            with torch.no_grad():
                y[1] = model(x[1:2]).argmin()
        return x, y
    n_out = model.net[-1].out_features
    obs = torch.randn(8, 4, generator=g).to(model.net[0].weight.dtype)
    y = torch.randint(0, n_out, (8,), generator=g)
    if step == 2:
        obs[5] *= 1e3 if kind == "eps" else 1e4  # a sensor glitch
        with torch.no_grad():
            out = model(obs[5:6])
            y[5] = out.argmax() if kind == "unlike" else out.argmin()
    if kind == "pg":
        explore = torch.rand(8, generator=g) < 0.3
        explore[5] = step == 2 or bool(explore[5])
        return obs, (y, torch.randn(8, generator=g), explore)
    return obs, y


MODELS = {"pg": (lambda: Net(3), pg_loss), "ptr": (Pointer, pointer_loss),
          "ptr_ent": (Pointer, pointer_entropy_loss), "onehot": (lambda: Net(5), onehot_loss),
          "sig": (lambda: Net(5), tag_loss), "unlike": (lambda: Net(3), unlikelihood), "eps": (lambda: Net(3), eps_loss)}


def run(kind, folder=None, f64=False):
    """Four optimizer steps; with a folder, under NanGuard (stops at the failure); else plainly: (loss, grad norm).
    The eps loop runs in float16 (f64: the same loop in float64, the reference for its healthy steps)."""
    if kind == "hf":
        return hf_run(folder)
    torch.manual_seed(0)
    make, loss_fn = MODELS[kind]
    model = make()
    if kind == "eps":
        model = model.to(torch.float64 if f64 else torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=folder) if folder else None
    out = []
    for step in range(4):
        x, y = batches(kind, step, model)
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        if guard:
            if not guard.step(loss):
                return guard.last_snapshot
            continue
        loss.backward()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
        out.append((loss.item(), norm.item()))
        if torch.isfinite(norm):  # a non-finite update is skipped, so that the steps after it run
            opt.step()
    return out


def hf_run(folder=None):
    """A tiny random GPT-2 in a Trainer subclass whose compute_loss anneals a temperature (1, 0.1, 0.01, 0.001)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.roll(-1)}

    class Tempered(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            temperature = 10.0 ** -self.state.global_step
            probs = torch.softmax(outputs.logits / temperature, -1)  # LINE: hf probs
            loss = -torch.log(probs.gather(-1, labels[..., None])).mean()  # LINE: hf log
            seen.append(loss.item())
            return (loss, outputs) if return_outputs else loss

    class Norms(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            norms.append(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None)).item())

    seen, norms = [], []
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=folder or "hf_out", max_steps=4, per_device_train_batch_size=2,
                             learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=0.0,
                             train_sampling_strategy="sequential")
    trainer = Tempered(model=model, args=args, train_dataset=Tokens(), callbacks=[Norms()])
    if folder:
        import nanreplay.transformers

        cb = nanreplay.transformers.attach(trainer, folder)
        try:
            trainer.train()
        except Exception as e:
            if type(e).__name__ != "TrainingStopped":
                raise
        return cb.guard.last_snapshot
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its metrics: stdout is the JSON
        trainer.train()
    return list(zip(seen, norms))


if __name__ == "__main__":
    if sys.argv[1] in ("--plain", "--f64"):
        print(json.dumps({k: run(k, f64=sys.argv[1] == "--f64") for k in sys.argv[2:]}))
    else:
        for kind in sys.argv[2:]:
            print(kind, run(kind, f"{sys.argv[1]}/{kind}"))
'''

pytestmark = pytest.mark.integrations  # training loops run and analyzed in subprocesses, as test_new_families.py

KINDS = ("pg", "ptr", "ptr_ent", "onehot", "sig", "unlike", "eps")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("logselection")
    return root, train_and_analyze_isolated(root, "logsel", TRAINING, KINDS, ENV)


def _exact(d: dict, kind: str, cause: str = "log_softmax") -> dict:
    assert d["culprit"]["forward_op"].startswith("aten.log"), d["culprit"]
    diag = d["diagnosis"]
    assert diag["cause"] == cause, (diag["cause"], diag["title"], diag["fix"]["code"])
    fix = diag["fix"]
    assert fix["kind"] == cause and fix["verified"] is True, fix["verification"]
    assert fix["epsilon"] is None and "1e-" not in fix["code"], fix["code"]
    return fix


def _edit(fix: dict, line: int) -> dict:
    return next(e for e in fix["edits"] if e["line"] == line)


def test_policy_gradient_keeps_probs_for_sampling_and_entropy_and_selects_from_log_softmax(runs):
    root, out = runs
    fix = _exact(out["pg"], "pg")
    assert out["pg"]["culprit"]["source"]["line"] == marker_line(TRAINING, "pg log")
    made = _edit(fix, marker_line(TRAINING, "pg probs"))
    assert made["after"].splitlines() == ["probs = torch.softmax(logits / 0.5, -1)  # LINE: pg probs",
                                          "log_probs = torch.log_softmax(logits / 0.5, -1)"], made
    assert _edit(fix, marker_line(TRAINING, "pg log"))["after"].startswith(
        "return -(log_probs.gather(1, taken[:, None]).squeeze(1) * adv).mean()"), fix
    apply_and_train(root / "fixed_pg", TRAINING, "logsel", "pg", fix, bad=2, env=ENV)


def test_pointer_softmax_in_the_forward_becomes_log_softmax_and_the_index_is_kept(runs):
    root, out = runs
    fix = _exact(out["ptr"], "ptr")
    assert _edit(fix, marker_line(TRAINING, "ptr softmax"))["after"].startswith("return F.log_softmax(scores, -1)")
    assert _edit(fix, marker_line(TRAINING, "ptr log"))["after"].startswith(
        "return -probs[torch.arange(len(y)), y].mean()"), fix
    assert "holds log-probabilities" in fix["reasoning"]
    apply_and_train(root / "fixed_ptr", TRAINING, "logsel", "ptr", fix, bad=2, env=ENV)


def test_one_hot_product_sum_on_one_line(runs):
    root, out = runs
    fix = _exact(out["onehot"], "onehot")
    assert fix["after"].startswith("return -(torch.log_softmax(logits, -1) * F.one_hot(y, 5)).sum(-1).mean()"), fix
    apply_and_train(root / "fixed_onehot", TRAINING, "logsel", "onehot", fix, bad=2, env=ENV)


def test_sigmoid_gathered_then_logged_becomes_logsigmoid(runs):
    root, out = runs
    fix = _exact(out["sig"], "sig", "logsigmoid")
    assert [e["after"].split("  #")[0].replace("torch.nn.functional.", "F.") for e in fix["edits"]] == [
        "log_p = F.logsigmoid(logits)", "return -log_p.gather(1, y[:, None]).mean()"], fix["edits"]
    apply_and_train(root / "fixed_sig", TRAINING, "logsel", "sig", fix, bad=2, env=ENV)


def test_a_users_epsilon_inside_the_log_is_dropped_by_the_exact_form(runs):
    root, out = runs
    fix = _exact(out["eps"], "eps")
    assert [e["after"].split("  #")[0] for e in fix["edits"]] == [
        "log_policy = torch.log_softmax(logits, -1)", "return -log_policy.gather(1, y[:, None]).mean()"], fix["edits"]
    # float16: the healthy steps at least as close to the same loop in float64 as the original's
    apply_and_train(root / "fixed_eps", TRAINING, "logsel", "eps", fix, bad=2, env=ENV, coarse=True)


def test_a_log_of_something_else_made_from_the_probs_is_not_a_selection(runs):
    _, out = runs
    d = out["unlike"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "unlike")
    diag = d["diagnosis"]
    assert diag["cause"] not in ("log_softmax", "logsigmoid"), diag["fix"]["code"]
    assert "log_softmax" not in diag["fix"]["code"], diag["fix"]["code"]


def test_a_softmax_made_elsewhere_and_read_by_more_than_the_log_is_not_rewritten(runs):
    _, out = runs
    d = out["ptr_ent"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "ptr entropy")
    fix = d["diagnosis"]["fix"]
    assert not any(e["line"] == marker_line(TRAINING, "ptr softmax") for e in fix["edits"]), fix["edits"]


def test_hf_trainer_subclass_compute_loss_gathers_from_log_softmax(tmp_path):
    framework("transformers")
    env = {**ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = train_and_analyze_isolated(tmp_path, "logsel", TRAINING, ("hf",), env)
    d = out["hf"]
    assert d["culprit"]["source"]["line"] == marker_line(TRAINING, "hf log")
    fix = _exact(d, "hf")
    made = _edit(fix, marker_line(TRAINING, "hf probs"))
    assert made["after"].splitlines()[-1] == "log_probs = torch.log_softmax(outputs.logits / temperature, -1)", made
    assert _edit(fix, marker_line(TRAINING, "hf log"))["after"].startswith(
        "loss = -log_probs.gather(-1, labels[..., None]).mean()"), fix
    apply_and_train(tmp_path / "fixed_hf", TRAINING, "logsel", "hf", fix, bad=3, env=env)
