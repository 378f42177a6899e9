"""Gradients that die or are cut (#39): the guard's triggers on real loops, each snapshot analyzed with no flags in a
fresh python where the training code cannot be imported; and the loops where a zero or missing gradient is routine
(an unused module, an unrouted expert, a zero-initialised LoRA B, a GRPO batch whose advantages are all zero) that
must write nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanreplay import NanGuard
from tests.isolation import ROOT, analyze_isolated, framework

HERE = Path(__file__).resolve().parent
KINDS = ("dead_relu", "skip_detach", "argmax_router", "sigmoid_gate", "no_grad_helper", "tied_frozen", "broadcast_mse",
         "swiftformer", "vit_reentrant", "bert_tied_frozen", "broadcast_healthy", "skip_detach_again",
         "own_reentrant", "dead_init", "round_path", "data_cut", "rnn_saturated")


def culprit_line(marker: str = "# CULPRIT") -> list[int]:
    return [i for i, ln in enumerate((HERE / "flowtrain.py").read_text().splitlines(), 1)
            if ln.rstrip().endswith(marker) or f"{marker}:" in ln]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    framework("transformers")
    root = tmp_path_factory.mktemp("flow")
    proj = root / "proj"
    proj.mkdir()
    (proj / "flowtrain.py").write_text((HERE / "flowtrain.py").read_text())
    res = subprocess.run([sys.executable, "flowtrain.py", str(root), *KINDS], cwd=proj, capture_output=True, text=True,
                         timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {ln.split()[0]: ln.split()[1] for ln in res.stdout.splitlines() if ln.split() and ln.split()[0] in KINDS}
    assert set(rows) == set(KINDS) and all(p.endswith(".pt") for p in rows.values()), res.stdout
    out = analyze_isolated(list(rows.values()), root / "elsewhere", also_blocked=("flowtrain",))
    return {k: out[rows[k]] for k in KINDS}, rows


def _first(d: dict) -> dict:
    gf = d["gradient_flow"]
    return next(r for r in gf["per_parameter"] if r["verdict"] == gf["verdict"])


def _line(row: dict) -> tuple[str, int]:
    src = row["source"]
    return Path(src["file"]).name, src["line"]


def test_dead_relu_after_an_lr_jump_is_a_zeroing_relu_and_the_rate_is_the_cause(runs):
    d, paths = runs[0]["dead_relu"], runs[1]
    assert "gradient_died" in paths["dead_relu"]
    assert d["verdict"] == "gradient_zero" and d["snapshot_info"]["trigger"] == "gradient_died"
    assert set(d["gradient_flow"]["parameters"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "out.weight"}
    row = _first(d)
    assert row["op"] == "aten.relu.default" and row["kind"] == "relu" and row["local_zero"]["units"] == 1.0
    assert _line(row) == ("flowtrain.py", culprit_line("# RELU")[0])
    assert d["gradient_flow"]["lr_jump"] == {"from": 0.01, "to": 30.0, "step": 4}
    diag = d["diagnosis"]
    assert "jumped from 0.01 (steps 0–3) to 30 at step 4" in diag["explanation"]
    # the jump is the cause (flow_divergence): the fix is the rate the history trained at, the dead ReLU the mechanism
    assert diag["cause"] == "training_diverged" and diag["divergence"]["lr_jump"]["after"] == 30.0
    fix = diag["fix"]
    assert fix["kind"] == "lower_lr_clip_grads" and fix["settings"] == {"lr_bound": 0.01}
    # the rate went back to 0.01 after the one step at 30: the loop's write is still the line to bound
    (edit,) = fix["edits"]
    assert edit["before"] == 'g["lr"] = (lr_at or {}).get(step, lr)'
    assert edit["after"] == 'g["lr"] = min((lr_at or {}).get(step, lr), 0.01)'
    # the activation's own fix, kept as the mechanism's: replayed with LeakyReLU the gradient flows, but the jump blew
    # the weights up: 1% of inputs that far below zero changes the loss by orders of magnitude, so it is not verified
    own = diag["mechanism"]["fix"]
    assert diag["mechanism"]["kind"] == "relu" and own["kind"] == "leaky_relu"
    assert own["verified"] is False and own["replay"]["loss_change"] > 1 and "re-initialise" in own["verification"]


def test_the_dead_relus_rate_bound_applied_trains_on_without_a_dead_gradient(runs, tmp_path):
    """The edit made in a copy of the loop, the same run trained again under the guard: no snapshot at all."""
    from tests.isolation import apply_edits

    (tmp_path / "flowtrain.py").write_text((HERE / "flowtrain.py").read_text())
    apply_edits(tmp_path / "flowtrain.py", runs[0]["dead_relu"]["diagnosis"]["fix"]["edits"])
    res = subprocess.run([sys.executable, "flowtrain.py", str(tmp_path / "out"), "dead_relu"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["dead_relu", "none", "[]"], res.stdout


def test_relu_units_dead_from_a_bad_init_are_repaired_by_leaky_relu_verified_by_replay(runs):
    """No lr jump here (none is named): the units' inputs sit a little below zero, so LeakyReLU gives every parameter
    a gradient and moves the loss only a little."""
    d = runs[0]["dead_init"]
    assert d["verdict"] == "gradient_zero" and _first(d)["kind"] == "relu" and d["gradient_flow"]["lr_jump"] is None
    assert _line(_first(d)) == ("flowtrain.py", culprit_line("# RELU")[0])
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "leaky_relu" and fix["verified"] is True and 0 < fix["replay"]["loss_change"] <= 0.5
    assert fix["replay"]["grad_norm"] > 0 and "jumped" not in d["diagnosis"]["explanation"]
    # a flat loss history: no divergence, the ReLU keeps the blame (flow_divergence leaves it alone)
    assert d["diagnosis"]["cause"] == "gradient_zero" and "mechanism" not in d["diagnosis"]


def test_the_dead_relus_leaky_relu_is_an_edit_of_its_line_and_applied_trains_with_no_snapshot(runs, tmp_path):
    """The verified LeakyReLU is shown as the change of the ReLU's own line (it used to be advice only); made in a
    copy of the loop, the same run under the guard writes no snapshot: the gradient is no longer zero."""
    from tests.isolation import apply_edits

    fix = runs[0]["dead_init"]["diagnosis"]["fix"]
    assert [(e["before"], e["after"]) for e in fix["edits"]] == [
        ("h = F.relu(self.fc2(h))  # RELU", "h = F.leaky_relu(self.fc2(h), 0.01)  # RELU")], fix["edits"]
    (tmp_path / "flowtrain.py").write_text((HERE / "flowtrain.py").read_text())
    apply_edits(tmp_path / "flowtrain.py", fix["edits"])
    res = subprocess.run([sys.executable, "flowtrain.py", str(tmp_path / "out"), "dead_init"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["dead_init", "none", "[]"], res.stdout


def test_a_detach_on_the_skip_connection_is_cut_there_and_removing_it_is_verified(runs):
    d, paths = runs[0]["skip_detach"], runs[1]
    assert "no_gradient" in paths["skip_detach"] and d["verdict"] == "gradient_cut"
    assert set(d["gradient_flow"]["parameters"]) == {"inp.weight", "inp.bias"}
    row = _first(d)
    assert row["op"] == "aten.detach.default" and _line(row) == ("flowtrain.py", culprit_line()[0])
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "remove_cut" and fix["verified"] is True and fix["replay"]["loss_unchanged"] is True
    (edit,) = fix["edits"]  # the line without its detaches: the change the replay verified
    assert edit["line"] == culprit_line()[0] and edit["after"].startswith("h = h + self.block(h)")


def test_a_router_through_argmax_is_cut_at_the_argmax(runs):
    d = runs[0]["argmax_router"]
    assert d["verdict"] == "gradient_cut" and set(d["gradient_flow"]["parameters"]) == {"router.weight", "router.bias"}
    row = _first(d)
    assert row["op"] == "aten.argmax.default" and row["kind"] == "integer"
    assert _line(row) == ("flowtrain.py", culprit_line()[1])
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "straight_through" and "softmax probability" in fix["code"] and ".detach()" in fix["code"]


def test_a_saturated_sigmoid_gate_zeroes_the_gradient_at_the_sigmoid(runs):
    d = runs[0]["sigmoid_gate"]
    assert d["verdict"] == "gradient_zero" and set(d["gradient_flow"]["parameters"]) == {"gate.weight", "gate.bias"}
    row = _first(d)
    assert row["op"] == "aten.sigmoid.default" and row["kind"] == "saturated"
    assert _line(row) == ("flowtrain.py", culprit_line()[2]) and row["local_zero"]["elements"] == 1.0
    assert d["diagnosis"]["fix"]["kind"] == "logits"


def test_a_helper_under_no_grad_is_cut_and_running_it_with_grad_is_verified(runs):
    d = runs[0]["no_grad_helper"]
    assert d["verdict"] == "gradient_cut" and set(d["gradient_flow"]["parameters"]) == {"proj.weight", "proj.bias"}
    row = _first(d)
    assert row["kind"] == "no_grad" and _line(row) == ("flowtrain.py", culprit_line()[3])
    assert d["diagnosis"]["fix"]["verified"] is True


def test_a_frozen_tied_weight_is_reported_with_its_other_name(runs):
    d = runs[0]["tied_frozen"]
    assert d["verdict"] == "gradient_cut" and _first(d)["kind"] == "frozen"
    assert "embed.weight" in d["diagnosis"]["explanation"] and d["diagnosis"]["fix"]["kind"] == "unfreeze"
    fix = d["diagnosis"]["fix"]  # replayed with requires_grad on: the same loss, a gradient
    assert fix["verified"] is True and fix["replay"]["loss_unchanged"] is True and fix["replay"]["grad_norm"] > 0


def test_a_users_own_reentrant_checkpoint_after_a_frozen_layer_is_cut_at_its_call(runs):
    d = runs[0]["own_reentrant"]
    assert d["verdict"] == "gradient_cut" and set(d["gradient_flow"]["parameters"]) == {"block.0.weight", "block.0.bias"}
    row = _first(d)
    assert row["kind"] == "reentrant_checkpoint" and row["module"] == "block"
    assert _line(row) == ("flowtrain.py", culprit_line("# CKPT")[0])
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "use_reentrant_false" and fix["verified"] is True and fix["replay"]["loss_unchanged"] is True


def test_transformers_bert_with_frozen_token_embeddings_freezes_its_tied_mlm_decoder(runs):
    """Freezing BERT's word embeddings freezes the masked-LM decoder's weight too (the same tensor), while the
    decoder's bias trains on: named at the decoder's call, and unfreezing it is verified by replay."""
    d = runs[0]["bert_tied_frozen"]
    assert d["verdict"] == "gradient_cut" and d["gradient_flow"]["parameters"] == ["cls.predictions.decoder.weight"]
    row = _first(d)
    assert row["kind"] == "frozen" and row["module"] == "cls.predictions.decoder"
    assert _line(row)[0] == "modeling_bert.py" and "self.decoder(" in row["source"]["code"]
    assert "bert.embeddings.word_embeddings.weight" in d["diagnosis"]["explanation"]
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "unfreeze" and fix["verified"] is True and fix["replay"]["loss_unchanged"] is True


def test_the_cli_summary_says_where_the_flow_ends_and_never_not_reproduced_first(runs, tmp_path):
    """`nanreplay analyze` with no flags, from a folder where the training code cannot be imported: the terminal
    names the verdict once (the replay alone, finite, would say "not reproduced": the diagnosis decides), where
    the flow ends with the line's code, the parameters, and for dead units their share and the lr jump."""
    from tests.clirun import run

    paths = runs[1]
    res = run("analyze", paths["dead_relu"], "--no-report", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "not reproduced" not in out and out.splitlines()[0].endswith(": gradient zero")
    assert f"flowtrain.py:{culprit_line('# RELU')[0]}" in out and "h = F.relu(self.fc2(h))" in out
    assert "100% of its units" in out and "jumped from 0.01 to 30 at step 4" in out
    res = run("analyze", paths["vit_reentrant"], "--no-report", "--markdown", "-", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "not reproduced" not in out and "modeling_layers.py:" in out and "_gradient_checkpointing_func" in out
    assert "verified by replay" in out
    res = run("analyze", paths["skip_detach"], "--no-report", "--no-verify", cwd=tmp_path)  # no replay of the fix
    assert res.exit_code == 0 and "[not verified]" in res.output and "(not replayed)" in res.output, res.output


def test_a_broadcasting_mse_is_flagged_with_its_line_in_an_analysis_of_another_failure(runs):
    d = runs[0]["broadcast_mse"]
    assert d["verdict"] == "nonfinite_input"  # the snapshot is for a NaN in the batch; the loss is wrong anyway
    (b,) = d["broadcast"]
    assert b["op"] == "aten.mse_loss.default" and b["shapes"] == [[8, 1], [8]] and b["broadcast_to"] == [8, 8]
    assert _line(b) == ("flowtrain.py", culprit_line()[4]) and b["message"] in d["warnings"]


def test_transformers_swiftformer_never_trains_w_g_its_softmax_runs_over_one_element(runs):
    """Found by the false-alarm sweep: transformers' SwiftFormer takes `softmax(dim=-1)` of a [B, N, 1] tensor, which
    is 1 whatever w_g is; w_g's gradient is exactly zero on every step."""
    d = runs[0]["swiftformer"]
    assert d["verdict"] == "gradient_zero"
    assert d["gradient_flow"]["parameters"] and all(n.endswith("attn.w_g") for n in d["gradient_flow"]["parameters"])
    row = _first(d)
    assert row["op"] == "aten._softmax.default" and row["kind"] == "softmax_single"
    assert _line(row)[0] == "modeling_swiftformer.py" and "softmax(dim=-1)" in row["source"]["code"]
    assert d["diagnosis"]["fix"]["kind"] == "softmax_dim"


def test_transformers_reentrant_checkpointing_with_frozen_embeddings_is_cut_there_and_use_reentrant_false_verified(runs):
    """transformers#21381: no checkpointed layer's input needs a gradient, so no encoder layer gets one."""
    d, paths = runs[0]["vit_reentrant"], runs[1]
    assert "no_gradient" in paths["vit_reentrant"] and d["verdict"] == "gradient_cut"
    names = d["gradient_flow"]["parameters"]
    assert names and all(n.startswith("vit.layers.") for n in names)
    assert any(n.startswith("vit.layers.1.") for n in names)  # every layer, not only the first
    row = _first(d)
    assert row["kind"] == "reentrant_checkpoint" and row["module"] == "vit.layers.0"
    # the cut is the checkpoint call (transformers' checkpointing wrapper), from the encoder's layer loop; the
    # region's first op (a projection inside the layer) is kept as what it ran
    ck = row["checkpoint"]
    assert _line(row)[0] == "modeling_layers.py" and "_gradient_checkpointing_func" in row["source"]["code"]
    assert Path(ck["caller"]["file"]).name == "modeling_vit.py" and "layer(hidden_states" in ck["caller"]["code"]
    assert Path(ck["inside"]["file"]).name == "modeling_vit.py" and ck["first_op"] == row["op"]
    assert "the checkpoint of module 'vit.layers.0', called at" in d["diagnosis"]["explanation"]
    fix = d["diagnosis"]["fix"]
    assert fix["kind"] == "use_reentrant_false" and fix["verified"] is True


def test_a_broadcasting_mse_is_flagged_in_the_analysis_of_a_healthy_step_and_in_every_summary(runs, tmp_path):
    from tests.clirun import run

    d = runs[0]["broadcast_healthy"]
    assert d["loss"] is not None and d["failure"] is None  # a finite step
    (b,) = d["broadcast"]
    assert b["broadcast_to"] == [8, 8] and _line(b) == ("flowtrain.py", culprit_line()[4])
    res = run("analyze", runs[1]["broadcast_healthy"], "--no-report", "--markdown", "-", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    line = f"flowtrain.py:{culprit_line()[4]}"
    assert "**Shape bug:**" in res.output and "shape    aten.mse_loss.default broadcasts [8, 1] with [8]" in res.output
    assert res.output.count(line) >= 2  # the Markdown's and the terminal's


def test_no_broadcast_is_flagged_where_shapes_match(runs):
    assert all("broadcast" not in runs[0][k] for k in KINDS if not k.startswith("broadcast"))


# ------------------------------------------------------------------ routine zeros: nothing written


class Unused(nn.Module):
    """A pooler whose output is dropped and two experts of which one is routed per step."""

    def __init__(self):
        super().__init__()
        self.body, self.pooler = nn.Linear(8, 8), nn.Linear(8, 8)
        self.experts = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])
        self.lora_a, self.lora_b = nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False)
        nn.init.zeros_(self.lora_b.weight)  # LoRA: B = 0, so A's first gradient is exactly zero

    def forward(self, x, step=0):
        h = torch.tanh(self.body(x) + self.lora_b(self.lora_a(x)))
        self.pooler(h)  # computed and dropped
        return self.experts[self.k](h)


def _quiet_loop(tmp_path, model, steps, target=None):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path)
    for step in range(steps):
        model.k = step % 2
        x = torch.randn(16, 8)
        y = target(step) if target else torch.randn(16, 1)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        assert guard.loss_ok(loss)
        loss.backward()
        assert guard.grads_ok()
        opt.step()
    return guard


def test_unused_modules_unrouted_experts_and_a_zero_lora_b_write_nothing(tmp_path):
    torch.manual_seed(0)
    guard = _quiet_loop(tmp_path, Unused(), 6)
    assert guard.flow_snapshots == [] and guard.snapshots == [] and not list(tmp_path.glob("*.pt"))


def test_steps_whose_every_gradient_is_zero_fire_only_after_a_long_run_of_them(tmp_path):
    """A GRPO group with equal rewards has zero advantage: its loss (and every gradient) is exactly zero."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=None, step_fn=lambda m, b: (m(b[0]) * b[1]).mean(), folder=tmp_path,
                     check_flow={"all_zero_steps": 4})
    for step in range(7):
        adv = torch.zeros(16, 1) if step < 3 or step >= 3 + 1 else torch.randn(16, 1)  # 3 zero, 1 not, 3 zero
        batch = (torch.randn(16, 8), adv)
        guard.begin(batch, step=step)
        opt.zero_grad()
        loss = guard.step_fn(model, batch)
        guard.loss_ok(loss)
        loss.backward()
        guard.grads_ok()
        opt.step()
    assert guard.flow_snapshots == []  # never 4 all-zero steps in a row
    for step in range(7, 9):
        batch = (torch.randn(16, 8), torch.zeros(16, 1))
        guard.begin(batch, step=step)
        opt.zero_grad()
        loss = guard.step_fn(model, batch)
        guard.loss_ok(loss)
        loss.backward()
        guard.grads_ok()
    assert len(guard.flow_snapshots) == 1 and "gradient_died" in guard.flow_snapshots[0]
    d = torch.load(guard.flow_snapshots[0], weights_only=True)
    assert d["gradient_flow"]["all_zero"] is True


def test_ignore_silences_named_parameters_only(tmp_path):
    """An RNN cell run once from a zero state: weight_hh multiplies zeros (a zero gradient on every step; inert, so
    a snapshot only with {"inert": True})."""
    torch.manual_seed(0)
    for ignore, fired in (([], True), (["weight_hh"], False)):
        model = nn.Sequential(nn.Linear(4, 4), nn.RNNCell(4, 4), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path / str(fired),
                         check_flow={"ignore": ignore, "inert": True})
        for step in range(4):
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            guard.begin(x, y, step=step)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            guard.loss_ok(loss)
            loss.backward()
            guard.grads_ok()
            opt.step()
        assert bool(guard.flow_snapshots) is fired
        if fired:
            dead = torch.load(guard.flow_snapshots[0], weights_only=True)["gradient_flow"]["dead"]
            assert [d["name"] for d in dead] == ["1.weight_hh"]


def test_check_flow_false_silences_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, check_flow=False)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    guard.begin(x, y, step=0)
    loss = F.mse_loss(model[1](model[0](x).detach()), y)
    guard.loss_ok(loss)
    loss.backward()
    assert guard.grads_ok() and guard.flow_snapshots == []


def test_triage_groups_dead_gradients_by_verdict_op_and_line(runs):
    from nanreplay.triage.groups import signature
    from nanreplay.triage.worker import analysis_fields

    sig = {k: signature(analysis_fields(runs[0][k])) for k in KINDS if not k.startswith("broadcast")
           and k not in ("skip_detach_again", "own_reentrant", "dead_init")}
    assert len(set(sig.values())) == len(sig)  # one root cause each
    cut = analysis_fields(runs[0]["skip_detach"])
    assert (cut["verdict"], cut["op"], cut["source_line"]) == ("gradient_cut", "aten.detach.default", culprit_line()[0])
    again = analysis_fields({**runs[0]["skip_detach"], "snapshot": "another.pt"})
    assert signature(again) == sig["skip_detach"]


def test_triage_puts_two_runs_of_the_same_cut_in_one_group_and_other_families_apart(runs, tmp_path):
    """`nanreplay triage DIR` on dead-gradient snapshots: two runs (other seeds, other weights) cut by the same detach
    are one incident; a dead ReLU and a reentrant checkpoint are their own."""
    import json
    import shutil

    from tests.clirun import run

    folder = tmp_path / "snaps"
    folder.mkdir()
    for k in ("skip_detach", "skip_detach_again", "dead_relu", "vit_reentrant"):
        shutil.copy(runs[1][k], folder / f"{k}.pt")
    res = run("triage", folder, "-o", tmp_path / "out", "-j", "1", "-q", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    groups = json.loads((tmp_path / "out" / "groups.json").read_text())["groups"]
    by = {g["verdict"] + ":" + str(g["kind"]): g for g in groups}
    assert sorted(by) == ["gradient_cut:detach", "gradient_cut:reentrant_checkpoint", "gradient_zero:relu"]
    cut = by["gradient_cut:detach"]
    assert sorted(s["file"] for s in cut["snapshots"]) == ["skip_detach.pt", "skip_detach_again.pt"]
    assert all(s["duplicate_of"] is None for s in cut["snapshots"])  # different files, one root cause
    assert cut["source"]["line"] == culprit_line()[0] and cut["fix"]["verified"] == 2


class DropDetach(nn.Module):
    """Dropout (the RNG), BatchNorm (buffers) and a detach (the flow check's re-run happens on every due step)."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.b(self.drop(self.bn(self.a(x))).detach() + self.drop(x))


def _train(tmp_path, check_flow) -> tuple[dict, list, NanGuard]:
    torch.manual_seed(0)
    model = DropDetach()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=tmp_path, check_flow=check_flow)
    losses = []
    for step in range(4):
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        guard.loss_ok(loss)
        loss.backward()
        guard.grads_ok()
        opt.step()
        losses.append(loss.detach())
    return {k: v.clone() for k, v in model.state_dict().items()}, losses, guard


def test_the_flow_checks_re_run_leaves_the_training_bitwise_unchanged(tmp_path):
    on, losses_on, guard = _train(tmp_path / "on", True)
    off, losses_off, _ = _train(tmp_path / "off", False)
    assert guard.flow_snapshots  # the check ran (and wrote) on this run
    assert all(torch.equal(a, b) for a, b in zip(losses_on, losses_off, strict=True))
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)


def test_a_round_in_the_path_is_not_inert_its_zero_is_named_at_the_round(runs):
    """round() has a zero derivative at every value, so the gradient stays zero at moved values too; but the loss
    moves with the encoder's values (in steps): not inert, a snapshot, the zero named at the round."""
    d, paths = runs[0]["round_path"], runs[1]
    assert "no_gradient" in paths["round_path"] and d["verdict"] == "gradient_zero"
    assert set(d["gradient_flow"]["parameters"]) == {"enc.weight", "enc.bias"}
    row = _first(d)
    assert row["op"] == "aten.round.default" and row["kind"] == "discrete"
    assert _line(row) == ("flowtrain.py", culprit_line("# ROUND")[0])
    assert d["diagnosis"]["fix"]["kind"] == "straight_through" and d["diagnosis"]["cause"] == "gradient_zero"


def test_a_weight_read_through_data_is_named_as_data_not_as_a_detach(runs):
    d = runs[0]["data_cut"]
    assert d["verdict"] == "gradient_cut" and d["gradient_flow"]["parameters"] == ["fc2.weight"]
    row = _first(d)
    assert row["kind"] == "data_copy" and _line(row) == ("flowtrain.py", culprit_line("# DATA")[0])
    assert ".data" in d["diagnosis"]["title"] and "detach" not in d["diagnosis"]["title"]
    fix = d["diagnosis"]["fix"]  # undone (the weight itself in place of its .data): the same loss, a gradient
    assert fix["verified"] is True and fix["replay"]["loss_unchanged"] is True
    (edit,) = fix["edits"]  # verified, so the line is given back without its `.data`
    assert edit["line"] == culprit_line("# DATA")[0] and ".data" in edit["before"]
    assert edit["after"].startswith("h = torch.tanh(F.linear(h, self.fc2.weight, self.fc2.bias))")


def test_a_saturated_rnn_is_zeroed_at_its_tanh_not_at_the_stack_of_its_states(runs):
    """The loss reads the last state only: `stack`'s backward gives the other states zeros while the last gets a
    gradient, so the flow goes on through it, to the saturated tanh."""
    d = runs[0]["rnn_saturated"]
    assert d["verdict"] == "gradient_zero" and {"rnn.weight_hh_l0", "rnn.bias_hh_l0"} <= set(
        d["gradient_flow"]["parameters"])
    row = _first(d)
    assert row["op"] == "aten.tanh.default" and row["kind"] == "saturated" and row["module"] == "rnn"
    assert _line(row) == ("flowtrain.py", culprit_line("# RNN")[0])
