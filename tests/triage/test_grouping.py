"""Triage groups one bug as one: the key is what does not move when code is edited (the file's name, the function,
the code line's text, the op), not the folder or the line number.

Real captures: the same model file captured twice with an edit above the culprit's line in between, and the
shipped sample reached from its native snapshot and from its plain state-dict twin (analyzed with --model).
"""

from __future__ import annotations

import importlib.util
import json
import linecache
import shutil
import sys

import pytest
import torch
from click.testing import CliRunner

from nanreplay import NanGuard
from nanreplay.cli import main
from nanreplay.triage.groups import signature
from samples import ROOT

MODEL = '''import torch
import torch.nn as nn


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 4)

    def forward(self, a, b):
        d = ((self.enc(a) - self.enc(b)) ** 2).sum(-1).sqrt()
        return d.mean()
'''


def _capture(src, name: str, folder) -> str:
    """Import `src` as module `name` and train until NanGuard writes a snapshot (identical pairs: sqrt(0))."""
    spec = importlib.util.spec_from_file_location(name, src)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    model = mod.Pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, opt, folder=folder, max_snapshots=1)
    for step in range(3):
        a = torch.randn(4, 6)
        b = a.clone() if step == 2 else a + 0.1
        guard.begin((a, b), step=step)
        opt.zero_grad()
        loss = model(a, b)
        assert guard.loss_ok(loss)
        loss.backward()
        if not guard.grads_ok():
            return guard.last_snapshot
        opt.step()
    raise AssertionError("never went non-finite")


def _triage(folder, out, *args) -> dict:
    res = CliRunner().invoke(main, ["triage", str(folder), "-o", str(out), "--jobs", "1", *args])
    assert res.exit_code == 0, res.output
    return json.loads((out / "groups.json").read_text())


def test_an_edit_above_the_line_between_two_captures_is_one_group(tmp_path):
    snaps = tmp_path / "snaps"
    src = tmp_path / "proj" / "pairmodel.py"
    src.parent.mkdir()
    src.write_text(MODEL)
    first = _capture(src, "pairmodel_v1", tmp_path / "a")
    src.write_text(MODEL.replace("import torch\n", "import torch\n# an edit above the culprit's line\n\n", 1))
    linecache.checkcache(str(src))  # (a second training process would read the edited file afresh)
    second = _capture(src, "pairmodel_v2", tmp_path / "b")
    snaps.mkdir()
    shutil.copy(first, snaps / "nan_step_a.pt")
    shutil.copy(second, snaps / "nan_step_b.pt")
    doc = _triage(snaps, tmp_path / "out")
    assert len(doc["groups"]) == 1, [(g["source"], g["op"]) for g in doc["groups"]]
    g = doc["groups"][0]
    assert g["count"] == 2 and g["cause"] == "sqrt_at_zero" and g["forward_op"] == "aten.sqrt.default"
    lines = {json.loads((tmp_path / "out" / s["json"]).read_text())["culprit"]["source"]["line"]
             for s in g["snapshots"]}
    assert lines == {11, 13}  # the line moved; the group did not


def test_the_same_line_from_two_snapshot_kinds_is_one_group(tmp_path, monkeypatch):
    """sample_snapshots/models.py:23 from the native sample and from its plain state-dict twin (--model)."""
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    shutil.copy(ROOT / "sample_snapshots" / "sqrt_zero.pt", snaps / "sqrt_zero.pt")
    shutil.copy(ROOT / "sample_snapshots" / "nan_snapshot_step_3.pt", snaps / "nan_snapshot_step_3.pt")
    monkeypatch.chdir(ROOT)
    doc = _triage(snaps, tmp_path / "out", "--model", "sample_snapshots.models:triplet")
    assert [(g["count"], g["cause"]) for g in doc["groups"]] == [(2, "sqrt_at_zero")], doc["groups"]


def _row(**kw):
    row = {"verdict": "culprit_found", "cause": "sqrt_at_zero", "op": "aten.div.Tensor",
           "forward_op": "aten.sqrt.default", "module": "enc", "source": "m.py:11", "source_path": "/a/m.py",
           "source_line": 11, "code": "d = x.sqrt()", "function": "forward"}
    return {**row, **kw}


@pytest.mark.parametrize("change, same", [
    ({"source_line": 14, "source": "m.py:14"}, True),  # an edit above: the line moved
    ({"source_path": "/elsewhere/checkout/m.py"}, True),  # another folder, another machine
    ({"code": "d  =  x.sqrt()"}, True),  # re-indented, re-spaced
    ({"module": "the model"}, True),  # the same line, named from another snapshot kind
    ({"code": "d = y.sqrt()"}, False),  # another line of code
    ({"function": "score"}, False),
    ({"source_path": "/a/other.py"}, False),
    ({"forward_op": "aten.log.default"}, False),
    ({"cause": "log_of_zero"}, False),
    ({"code": None, "source_line": 12}, False),  # no code text: the line number decides
])
def test_the_key_is_what_an_edit_does_not_move(change, same):
    assert (signature(_row(**change)) == signature(_row())) is same


def test_without_a_source_line_the_module_decides():
    bare = dict(source=None, source_path=None, source_line=None, code=None, function=None)
    assert signature(_row(**bare)) != signature(_row(**bare, module="head"))
    assert signature(_row(**bare)) == signature(_row(**bare, op="aten.div.Tensor"))


def test_csv_quotes_formulas_but_not_a_sign(tmp_path):
    import csv
    import io

    from nanreplay.triage import summary_csv

    rows = [{"file": "a.pt", "status": "analyzed", "inf_sign": sign, "code": code, "source_line": None}
            for sign, code in (("+", "=1+1"), ("-", "-x"), ("+-", "@A1"))]
    parsed = list(csv.DictReader(io.StringIO(summary_csv(rows))))
    assert [r["inf_sign"] for r in parsed] == ["+", "-", "+-"]
    assert [r["code"] for r in parsed] == ["'=1+1", "'-x", "'@A1"]
    assert [r["source_line"] for r in parsed] == ["", "", ""]
    from nanreplay.triage.worker import analysis_fields

    no_line = analysis_fields({"verdict": "culprit_found", "culprit": {"op": "aten.div.Tensor", "source": None}})
    assert no_line["source_line"] is None and no_line["function"] is None  # empty in the CSV, not 0


def test_the_why_column_never_splits_a_word():
    css = (ROOT / "nanreplay" / "report" / "templates" / "triage.css").read_text()
    page = (ROOT / "nanreplay" / "report" / "templates" / "triage.html.j2").read_text()
    assert 'data-label="why" class="why"' in page
    assert "td.why { overflow-wrap: normal; white-space: nowrap; }" in css


def test_the_progress_bar_counts_bytes_not_files(tmp_path):
    """The ETA comes from the work done: each finished snapshot advances the bar by its size."""
    from nanreplay import triage

    snaps = tmp_path / "snaps"
    snaps.mkdir()
    for name in ("sqrt_zero", "fp16_overflow"):
        shutil.copy(ROOT / "sample_snapshots" / f"{name}.pt", snaps / f"{name}.pt")
    plan = triage.plan(str(snaps), str(tmp_path / "out"), options=triage.Options(), recursive=False, use_cache=False)
    try:
        steps: list[int] = []
        triage.analyze(plan, jobs=1, progress=steps.append)
    finally:
        plan.release()
    sizes = sorted((snaps / f).stat().st_size for f in ("sqrt_zero.pt", "fp16_overflow.pt"))
    assert sorted(steps) == sizes and sizes[0] != sizes[1]
