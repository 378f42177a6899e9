"""A learning rate defined in another module of the user's (capture/rateimport.py): `from lrconf import LR`,
`import lrconf` + `lrconf.LR`, `from lrconf import cfg` + `cfg.lr`. The SGD rate diverges; the fix sets the rate
where it is defined (lrconf.py), not on the optimizer's line nor as advice. Before, there was no site, and the
fix was advice with no edit. Each snapshot is analyzed where neither file can be imported; the edit is applied
to a copy of lrconf.py and the loop trains on."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from isolation import ROOT, analyze_isolated, apply_edits

CONF = '''
LR = 3.0


class Config:
    lr = 3.0


cfg = Config()
'''

TRAIN = r'''
import json
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from nanreplay import NanGuard
IMPORT


def run(kind, folder=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=RATE)
    guard = NanGuard(model, opt, loss_fn=F.mse_loss, folder=folder) if folder else None
    losses = []
    for step in range(30):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 8, generator=g) * 3
        y = x.sum(-1, keepdim=True)
        if guard:
            guard.begin(x, y, step=step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if guard:
            if not guard.step(loss):
                return guard.last_snapshot
            continue
        losses.append(loss.item())
        loss.backward()
        opt.step()
    return losses


if __name__ == "__main__":
    if sys.argv[1] == "--losses":
        print(json.dumps({k: run(k) for k in sys.argv[2:]}))
    else:
        for kind in sys.argv[2:]:
            print(kind, run(kind, f"{sys.argv[1]}/{kind}"))
'''

pytestmark = pytest.mark.integrations  # training loops run and analyzed in subprocesses, as test_real_bugs3.py

KINDS = ("name", "module", "attribute")
SPELLED = {"name": ("from lrconf import LR", "LR"), "module": ("import lrconf", "lrconf.LR"),
           "attribute": ("from lrconf import cfg", "cfg.lr")}  # each its own loop: one optimizer line a file


def _train(kind: str) -> str:
    imp, rate = SPELLED[kind]
    return TRAIN.replace("IMPORT", imp).replace("RATE", rate)

ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
BEFORE = {"name": "LR = 3.0", "module": "LR = 3.0", "attribute": "lr = 3.0"}


def _losses(folder: Path, kind: str) -> list:
    res = subprocess.run([sys.executable, "lrtrain.py", "--losses", kind], cwd=folder, capture_output=True,
                         text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)[kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rateimport")
    rows = {}
    for kind in KINDS:
        proj = root / f"proj_{kind}"
        proj.mkdir()
        (proj / "lrtrain.py").write_text(_train(kind))
        (proj / "lrconf.py").write_text(CONF)
        res = subprocess.run([sys.executable, "lrtrain.py", str(root / "snaps"), kind], cwd=proj,
                             capture_output=True, text=True, timeout=600, env=ENV)
        assert res.returncode == 0, res.stderr[-3000:]
        rows.update(ln.split()[:2] for ln in res.stdout.splitlines() if ln.split()[:1] == [kind])
    assert set(rows) == set(KINDS), rows
    out = analyze_isolated(list(rows.values()), root / "elsewhere", also_blocked=("lrtrain", "lrconf"))
    return root, {k: out[rows[k]] for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_a_rate_imported_from_another_module_is_set_where_it_is_defined(runs, kind):
    root, out = runs
    fix = out[kind]["diagnosis"]["fix"]
    assert out[kind]["diagnosis"]["cause"] == "training_diverged"
    (e,) = fix["edits"]
    rate = fix["settings"]["lr"]
    assert Path(e["file"]).name == "lrconf.py" and e["before"] == BEFORE[kind], e
    assert e["after"] == BEFORE[kind].replace("3.0", repr(rate)) and rate < 3.0
    (site,) = fix["sites"]
    assert "lrtrain.py:" in site["evidence"] and "imported by `" in site["evidence"], site
    fixed = root / f"fixed_{kind}"
    fixed.mkdir()
    (fixed / "lrtrain.py").write_text(_train(kind))
    (fixed / "lrconf.py").write_text(CONF)
    apply_edits(fixed / "lrconf.py", [e])
    before, after = _losses(root / f"proj_{kind}", kind), _losses(fixed, kind)
    assert not all(math.isfinite(v) for v in before), before  # the rate as defined diverges
    assert all(math.isfinite(v) for v in after) and after[-1] < after[0], after  # the rate set there trains
