"""Fixes of the line that made the optimizer or the scheduler (#38): the guard records where they were made
(capture/sites.py), the analysis turns a rate, an eps or a schedule into an edit of that line (diagnose/edits/sitefix.py).
Real loops (sitetrain.py) break under NanGuard, each snapshot is analyzed in a fresh python where the training code
cannot be imported, the edits are applied to a copy of the file, and the copy trains on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clirun import one_line_error
from clirun import run as run_cli
from isolation import ROOT, analyze_isolated, apply_edits

from tolerance import close

HERE = Path(__file__).resolve().parent
KINDS = ("sgd", "sgdcfg", "sgdargs", "spike", "adam", "sched", "autocast")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
TEXT = (HERE / "sitetrain.py").read_text()


def line_of(text: str) -> int:
    return next(i for i, ln in enumerate(TEXT.splitlines(), 1) if text in ln)


def losses(folder: Path) -> dict:
    res = subprocess.run([sys.executable, "sitetrain.py", "--losses", *KINDS], cwd=folder, capture_output=True,
                         text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sites")
    proj = root / "proj"
    proj.mkdir()
    (proj / "sitetrain.py").write_text(TEXT)
    res = subprocess.run([sys.executable, "sitetrain.py", str(root / "snaps"), *KINDS], cwd=proj,
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = dict(ln.split()[:2] for ln in res.stdout.splitlines() if len(ln.split()) == 2 and ln.split()[0] in KINDS)
    assert set(rows) == set(KINDS), res.stdout
    out = analyze_isolated(list(rows.values()), root / "elsewhere", also_blocked=("sitetrain",))
    out = {k: out[rows[k]] for k in KINDS}
    fixed = root / "fixed"
    fixed.mkdir()
    (fixed / "sitetrain.py").write_text(TEXT)
    for k in KINDS:
        apply_edits(fixed / "sitetrain.py", out[k]["diagnosis"]["fix"]["edits"])
    return out, losses(proj), losses(fixed), rows


def _edit(runs, kind: str, made: str) -> dict:
    fix = runs[0][kind]["diagnosis"]["fix"]
    (e,) = fix["edits"]
    assert Path(e["file"]).name == "sitetrain.py" and e["line"] == line_of(made), e
    assert (fix["before"], fix["after"]) == (e["before"], e["after"])
    return e


def test_a_sgd_rate_that_diverges_is_set_on_the_line_that_made_the_optimizer_and_the_run_trains(runs):
    d = runs[0]["sgd"]["diagnosis"]
    assert d["cause"] == "training_diverged" and d["fix"]["kind"] == "lower_lr_clip_grads"
    e = _edit(runs, "sgd", "lr=3.0), None")
    rate = d["fix"]["settings"]["lr"]
    assert e["after"] == e["before"].replace("lr=3.0", f"lr={rate!r}") and rate < 3.0
    assert d["fix"]["verified"] is None and "judged over the steps that follow" in d["fix"]["verification"]
    before, after = runs[1]["sgd"], runs[2]["sgd"]
    assert not before["finite"] and after["finite"] and len(after["losses"]) == 8, (before, after)
    assert max(after["losses"]) < 2 * after["losses"][0], after  # no climb: the unpatched run is 10^19× by step 3
    assert after["losses"][0] == before["losses"][0]  # the same model and batch before any update


@pytest.mark.parametrize(("kind", "assigned", "literal", "made"), [
    ("sgdcfg", 'CONFIG = {"lr": 2.5', '"lr": 2.5', 'lr=CONFIG["lr"]), None'),  # a config dict's entry
    ("sgdargs", 'add_argument("--learning-rate"', "default=2.0", "lr=args.learning_rate), None"),  # argparse
])
def test_a_rate_given_by_name_is_set_where_the_name_is_assigned_and_the_run_trains(runs, kind, assigned, literal,
                                                                                     made):
    d = runs[0][kind]["diagnosis"]
    assert d["cause"] == "training_diverged" and d["fix"]["kind"] == "lower_lr_clip_grads"
    e = _edit(runs, kind, assigned)  # where the name is assigned, not the optimizer's line
    rate = d["fix"]["settings"]["lr"]
    old = float(literal.rsplit(" ", 1)[-1].rsplit("=", 1)[-1])
    assert e["after"] == e["before"].replace(literal, literal.replace(str(old), repr(rate))) and rate < old
    (site,) = d["fix"]["sites"]
    made = line_of(made)
    assert f"sitetrain.py:{made})" in site["evidence"] and "nothing else sets it" in site["evidence"]
    assert f"sitetrain.py:{e['line']}, which sets " in d["fix"]["reasoning"]
    before, after = runs[1][kind], runs[2][kind]
    assert not before["finite"] and after["finite"] and len(after["losses"]) == 8, (before, after)
    assert max(after["losses"]) < 2 * after["losses"][0], after
    assert after["losses"][0] == before["losses"][0]


def test_a_rate_written_in_the_loop_is_bounded_on_the_line_that_wrote_it_and_the_run_trains(runs):
    d = runs[0]["spike"]["diagnosis"]
    assert d["cause"] == "training_diverged" and d["fix"]["settings"] == {"lr_bound": 0.02}
    e = _edit(runs, "spike", 'g["lr"] *= 10 ** 6')  # the loop's write, not the optimizer's line (lr=0.02 is right)
    assert e["after"] == 'g["lr"] = min(g["lr"] * (10 ** 6), 0.02)', e
    assert "went from 0.02" in d["fix"]["sites"][0]["evidence"] and "judged over the steps" in d["fix"]["verification"]
    before, after = runs[1]["spike"], runs[2]["spike"]
    assert not before["finite"] and after["finite"] and len(after["losses"]) == 8, (before, after)
    assert max(after["losses"]) < 2 * after["losses"][0], after
    assert all(close(a, b) for a, b in zip(before["losses"][:4], after["losses"][:4], strict=True)), (before, after)


def test_an_adam_eps_that_float16_rounds_to_zero_is_raised_on_the_optimizers_line(runs):
    d = runs[0]["adam"]["diagnosis"]
    assert d["cause"] == "optimizer_eps" and d["fix"]["verified"] is True
    e = _edit(runs, "adam", "eps=1e-8), None")
    eps = d["fix"]["settings"]["eps"]
    assert e["after"] == e["before"].replace("eps=1e-8", f"eps={eps!r}")
    assert eps >= torch.finfo(torch.float16).tiny
    before, after = runs[1]["adam"], runs[2]["adam"]
    assert not before["finite"] and after["finite"] and len(after["losses"]) == 8, (before, after)
    assert after["losses"][0] == before["losses"][0]


def test_a_lambda_schedule_that_returns_inf_is_clamped_where_the_scheduler_is_made(runs):
    d = runs[0]["sched"]["diagnosis"]
    assert d["cause"] == "nonfinite_lr" and d["fix"]["kind"] == "lr_schedule" and d["fix"]["verified"] is True
    e = _edit(runs, "sched", "LambdaLR(opt, lambda s")
    assert "max(0.0, min(1.0, _f(s)))" in e["after"] and "rsqrt()" in e["after"]
    before, after = runs[1]["sched"], runs[2]["sched"]
    assert not before["finite"] and after["finite"] and len(after["losses"]) == 8, (before, after)
    assert all(close(a, b) for a, b in zip(before["losses"][:3], after["losses"][:3], strict=True)), (before, after)



def test_a_float16_autocast_that_overflows_becomes_bfloat16_on_the_autocast_line(runs):
    d = runs[0]["autocast"]["diagnosis"]
    assert d["cause"] == "fp16_overflow" and d["fix"]["kind"] == "bf16_or_grad_scaler" and d["fix"]["verified"] is True
    e = _edit(runs, "autocast", 'with torch.autocast("cpu", dtype=torch.float16):')
    assert e["after"] == 'with torch.autocast("cpu", dtype=torch.bfloat16):'
    before, after = runs[1]["autocast"], runs[2]["autocast"]
    assert not before["finite"] and after["finite"] and len(after["losses"]) == 8, (before, after)
    # a dtype change moves every value by up to its rounding: the healthy losses agree to bfloat16's resolution
    assert all(abs(a - b) <= 2 ** -7 * abs(a) for a, b in zip(before["losses"][:3], after["losses"][:3], strict=True))


# ---------------------------------------------------------------- a crafted snapshot's sites are data, never code

SITE = {"what": "optimizer", "class": "SGD", "file": "/home/u/train.py", "line": 12,
        "text": "    opt = torch.optim.SGD(model.parameters(), lr=3.0)", "values": {"lr": 3.0}, "evidence": "lr=3"}


def _attached(*sites: dict, lr: float = 0.1) -> tuple[dict, list[str]]:
    from nanreplay.diagnose.edits import sitefix
    diag = {"cause": "training_diverged", "fix": {"kind": "lower_lr_clip_grads", "code": "# lower it",
                                                   "edits": [], "settings": {"lr": lr}, "verified": None}}
    warnings: list[str] = []
    sitefix.attach(diag, {"optimizer": {"class": "SGD"}, "sites": list(sites)}, warnings)
    return diag["fix"], warnings


def test_a_recorded_optimizer_site_becomes_an_edit_of_its_literal_and_nothing_else():
    fix, warnings = _attached(SITE)
    assert warnings == [] and fix["edits"] == [{"file": "/home/u/train.py", "line": 12,
                                                "before": "opt = torch.optim.SGD(model.parameters(), lr=3.0)",
                                                "after": "opt = torch.optim.SGD(model.parameters(), lr=0.1)"}]
    assert fix["code"].startswith("# train.py:12\nopt = torch.optim.SGD(") and fix["code"].endswith("# lower it")


@pytest.mark.parametrize(("change", "why"), [
    ({"text": "    opt = __import__('os').system('x') or torch.optim.SGD(p, lr=3.0)"}, "its text names"),
    ({"text": "    opt = torch.optim.SGD(p, lr=3.0); eval(s)"}, "not one assignment"),
    ({"text": "    import os"}, "not one assignment"),
    ({"text": "    opt = torch.optim.SGD(p, lr=3.0"}, "not a Python statement"),
    ({"file": "/etc/passwd"}, "not a .py file"),
    ({"file": "train.py\x1b[2J"}, "not a .py file"),
    ({"class": "Adam", "text": "    opt = torch.optim.Adam(p, lr=3.0)"}, "not the run's SGD"),
    ({"values": {"lr": 0.5}}, "not the values recorded"),
    ({"evidence": "lr=3\x1b]0;owned\x07"}, "evidence holds control characters"),
    ({"class": "SGD(x); os"}, "class is not a name"),
    ({"text": "\n".join(["    opt = torch.optim.SGD("] + ["        p,"] * 30 + ["        lr=3.0)"])}, "lines long"),
])
def test_a_crafted_site_is_left_out_with_one_line_saying_why(change, why):
    fix, warnings = _attached({**SITE, **change})
    assert fix["edits"] == [] and "before" not in fix, fix  # the advice stays advice
    assert len(warnings) == 1 and why in warnings[0] and "\n" not in warnings[0], warnings


def test_a_site_of_the_wrong_type_refuses_the_snapshot_with_one_line(tmp_path, runs):
    path = tmp_path / "crafted.pt"
    d = torch.load(runs[3]["sched"], weights_only=True)
    d["sites"] = [{**SITE, "line": "12"}]
    torch.save(d, path)
    one_line_error(run_cli("analyze", path, cwd=tmp_path), 2, "sites[0].line")


# ---------------------------------------------------------------- at capture: a site only with evidence, never a guess

@pytest.mark.parametrize(("code", "found"), [
    ("a = torch.optim.SGD(p, lr=0.1)\nb = torch.optim.SGD(q, lr=0.5)\n", 1),   # told apart by the literal rate
    ("a = torch.optim.SGD(p, lr=0.1)\nb = torch.optim.SGD(q, lr=0.1)\n", None),  # two equal candidates: neither
    ("a = torch.optim.SGD(p, lr=lr)\n", None),  # no literal: nothing says this line made this optimizer
    ("a = torch.optim.SGD(p, 0.1, momentum=0.5)\n", None),  # a literal the run's optimizer does not have
    ("a = torch.optim.Adam(p, lr=0.1)\nb = torch.optim.SGD(q, 0.1)\n", 2),  # another class; a positional rate
])
def test_the_guard_records_an_optimizer_site_only_where_one_call_has_the_runs_literals(tmp_path, code, found):
    from nanreplay.capture import sites
    f = tmp_path / "loop.py"
    f.write_text(code)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    got = [s for s in sites.find([str(f)], opt, None, None) if s["what"] == "optimizer"]
    assert [s["line"] for s in got] == ([found] if found else []), got


@pytest.mark.parametrize(("code", "found"), [
    ("LR = 0.1\ndef main():\n    a = torch.optim.SGD(p, lr=LR)\n", 1),  # a module constant
    ("LR = 0.5\ndef main():\n    lr = 0.1\n    a = torch.optim.SGD(p, lr)\n", 3),  # a local, positional
    ("def main(steps=3, lr=0.1):\n    a = torch.optim.SGD(p, lr=lr)\n", 1),  # a default argument
    ("def main(steps=3, lr=0.1):\n    a = torch.optim.SGD(p, lr=lr)\nmain(lr=0.1)\n", None),  # a caller passes it
    ("def main(lr):\n    a = torch.optim.SGD(p, lr=lr)\n", None),  # the caller's value
    ("ap.add_argument('--learning-rate', type=float, default=0.1)\na = torch.optim.SGD(p, lr=args.learning_rate)\n",
     1),  # an argparse default
    ("class Cfg:\n    lr: float = 0.1\na = torch.optim.SGD(p, lr=Cfg().lr)\n", 2),  # a config class
    ("config = {'lr': 0.1}\na = torch.optim.SGD(p, lr=config['lr'])\n", 1),  # a dict entry
    ("config = {'lr': 0.1}\nconfig['lr'] = 0.1\na = torch.optim.SGD(p, lr=config['lr'])\n", None),  # two
    ("LR = 0.1\nif x:\n    LR = 0.1\na = torch.optim.SGD(p, lr=LR)\n", None),  # two assignments
    ("LR = 0.1\ndef f():\n    global LR\n    LR = 1.0\na = torch.optim.SGD(p, lr=LR)\n", None),  # a global write
    ("for lr in (0.1, 0.5):\n    a = torch.optim.SGD(p, lr=lr)\n", None),  # a loop over rates
    ("LR = 0.05 * 2\na = torch.optim.SGD(p, lr=LR)\n", None),  # computed: no literal says it
    ("LR = 0.5\na = torch.optim.SGD(p, lr=LR)\n", None),  # another rate than the run's
    ("LR = 0.1\na = torch.optim.SGD(p, lr=LR, momentum=0.5)\n", None),  # another optimizer's literal
    ("LR = 0.1\na = torch.optim.SGD(p, lr=LR)\nb = torch.optim.SGD(q, lr=0.1)\n", None),  # by name and literal
])
def test_a_rate_given_by_name_is_followed_to_its_one_literal_assignment(tmp_path, code, found):
    from nanreplay.capture import sites
    f = tmp_path / "loop.py"
    f.write_text(code)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    got = [s for s in sites.find([str(f)], opt, None, None) if s["what"] == "optimizer"]
    assert [s["line"] for s in got] == ([found] if found else []), got
    if got:
        fix, warnings = _attached({**got[0], "values": {"lr": 3.0}}, lr=0.01)
        assert len(warnings) == 1 and fix["edits"] == [], (fix, warnings)  # another rate: left out, one line
        fix, warnings = _attached(got[0], lr=0.01)
        (e,) = fix["edits"]
        line = code.splitlines()[found - 1].strip()
        assert (e["line"], e["before"], e["after"]) == (found, line, line.replace("0.1", "0.01", 1)), e


def test_a_crafted_rate_by_name_site_is_left_out_with_one_line():
    site = {**SITE, "text": "def train(lr=3.0):", "via": {"kind": "name", "name": "lr"}}
    fix, warnings = _attached(site)
    assert [e["after"] for e in fix["edits"]] == ["def train(lr=0.1):"] and warnings == []
    for change in ({"text": "@evil\ndef train(lr=3.0):"}, {"text": "LR = 3.0", "via": {"kind": "name", "name": "X"}},
                   {"text": "LR = 0.5"}, {"via": {"kind": "code", "name": "lr"}}):
        fix, warnings = _attached({**site, **change})
        assert fix["edits"] == [] and len(warnings) == 1, (change, fix, warnings)


@pytest.mark.parametrize(("code", "found"), [
    ("for g in opt.param_groups:\n    g['lr'] *= 10\n", [2]),
    ("for i, g in enumerate(opt.param_groups):\n    g['lr'] = warm(i)\nopt.param_groups[0]['lr'] = 1.0\n", [2, 3]),
    ("config = {}\nconfig['lr'] = 10.0\nfor g in groups:\n    g['lr'] = 1.0\n", []),  # dicts, not param groups
    ("".join(f"opt.param_groups[0]['lr'] = {k}.0\n" for k in range(5)), []),  # five writes: which one is a guess
])
def test_the_guard_records_the_statements_that_write_a_param_groups_rate(tmp_path, code, found):
    from nanreplay.capture import sites
    f = tmp_path / "loop.py"
    f.write_text(code)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    history = [{"step": 0, "lr": 0.1}]
    assert not [s for s in sites.find([str(f)], opt, None, None, history) if s["what"] == "lr_write"]  # unchanged
    opt.param_groups[0]["lr"] = 10.0
    got = [s for s in sites.find([str(f)], opt, None, None, history) if s["what"] == "lr_write"]
    assert [s["line"] for s in got] == found, got
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # its last rate is the rate now: it set it
    assert not [s for s in sites.find([str(f)], opt, sched, None, history) if s["what"] == "lr_write"]


def test_a_crafted_lr_write_site_is_left_out_and_a_recorded_one_is_bounded():
    from nanreplay.diagnose.edits import sitefix
    site = {"what": "lr_write", "class": "param_groups", "file": "/home/u/t.py", "line": 9, "text": "    g['lr'] /= 1e-6"}
    for change, after in (({}, "g['lr'] = min(g['lr'] / (1e-6), 0.01)"), ({"text": "cfg.lr = 5"}, None),
                          ({"text": "g['lr'] = os.system('x')"}, None), ({"class": "SGD"}, None)):
        diag = {"fix": {"kind": "lower_lr_clip_grads", "code": "", "edits": [], "settings": {"lr_bound": 0.01}}}
        warnings: list[str] = []
        sitefix.attach(diag, {"optimizer": {"class": "SGD"}, "sites": [{**site, **change}]}, warnings)
        assert [e["after"] for e in diag["fix"]["edits"]] == ([after] if after else []), (change, diag)
        assert len(warnings) == (0 if after else 1), warnings


AUTOCAST_SITE = {"what": "autocast", "class": "autocast", "file": "/home/u/t.py", "line": 7,
                 "text": "        with torch.autocast('cuda', dtype=torch.float16):"}


@pytest.mark.parametrize(("device", "capability", "edited"), [
    ("cuda", "7.5", False), ("cuda", "6.1", False),  # Turing, Pascal: no bfloat16
    ("cuda", "8.0", True), ("cuda", "9.0", True), ("cpu", None, True),  # Ampere, Hopper, the CPU
    ("cuda", None, True),  # a snapshot that does not record the capability is not judged
])
def test_the_bfloat16_autocast_edit_is_made_only_where_the_runs_device_has_bfloat16(device, capability, edited):
    from nanreplay.diagnose.edits import sitefix
    diag = {"fix": {"kind": "bf16_or_grad_scaler", "code": "with torch.autocast('cuda', dtype=torch.bfloat16):",
                    "edits": [], "settings": {"autocast_dtype": "bfloat16"}, "verified": True,
                    "alternatives": ["keep float16 autocast and scale the loss: scaler = torch.amp.GradScaler('cuda')"]}}
    raw = {"autocast": {"device_type": device, "dtype": "float16"}, "sites": [AUTOCAST_SITE],
           "machine": {"device_name": "Tesla T4", "capability": capability}}
    warnings: list[str] = []
    sitefix.attach(diag, raw, warnings)
    fix = diag["fix"]
    assert warnings == [] and bool(fix["edits"]) == edited, fix
    if edited:
        assert fix["edits"][0]["after"] == "with torch.autocast('cuda', dtype=torch.bfloat16):"
    else:
        assert f"compute capability {capability}) has no bfloat16" in fix["device"]
        assert "bfloat16" not in fix["code"].replace("has no bfloat16", "") and "GradScaler('cuda')" in fix["code"]


def test_an_argparse_default_given_on_the_command_line_is_not_the_rates_source(tmp_path, monkeypatch):
    from nanreplay.capture import sites
    f = tmp_path / "loop.py"
    f.write_text("ap.add_argument('--lr', type=float, default=0.1)\na = torch.optim.SGD(p, lr=args.lr)\n")
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    for argv, found in ((["train.py"], [1]), (["train.py", "--lr", "0.1"], []), (["train.py", "--lr=0.1"], [])):
        monkeypatch.setattr("sys.argv", argv)
        assert [s["line"] for s in sites.find([str(f)], opt, None, None)] == found, argv
