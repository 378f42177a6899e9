"""`nanreplay triage DIR` with sharded snapshot folders in DIR: each folder (every rank of one step) is one
incident, analyzed as a whole; re-running reuses the cache until a file in the folder changes."""

from __future__ import annotations

import json
import shutil

import pandas as pd
from click.testing import CliRunner

from nanreplay.cli import main


def test_a_folder_is_one_incident(runs, tmp_path):
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    for s in ("a", "c"):
        shutil.copytree(runs[s]["folder"], snaps / f"{s}_{runs[s]['folder'].name}")
    (snaps / "notes").mkdir()  # a folder that is not a snapshot: ignored
    (snaps / "notes" / "readme.txt").write_text("x")
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["triage", str(snaps), "-o", str(out), "-j", "1", "--no-verify", "-q"])
    assert res.exit_code == 0, res.output
    rows = pd.read_csv(out / "summary.csv").set_index("file")
    assert sorted(rows.index) == sorted(f"{s}_{runs[s]['folder'].name}" for s in ("a", "c"))
    by = {name[0]: r for name, r in rows.iterrows()}
    assert (by["a"]["status"], by["a"]["format"], by["a"]["rank"], by["a"]["world_size"]) == ("analyzed", "sharded", 1, 2)
    assert (by["a"]["op"], by["c"]["op"], by["c"]["rank"]) == ("aten.log.default", "aten.div.Tensor", 0)
    js = json.loads((out / by["a"]["json"]).read_text())
    assert js["distributed"]["crossed_to"] == [0] and js["culprit"]["rank"] == 1
    groups = json.loads((out / "groups.json").read_text())
    assert len(groups["groups"]) == 2
    again = CliRunner().invoke(main, ["triage", str(snaps), "-o", str(out), "-j", "1", "--no-verify", "-q"])
    assert again.exit_code == 0 and "(2 from cache)" in again.output, again.output
    folder_a = snaps / f"a_{runs['a']['folder'].name}"
    part = json.loads((folder_a / "rank0.json").read_text())
    part["notes"] = ["touched"]
    (folder_a / "rank0.json").write_text(json.dumps(part))  # a changed file in the folder: analyzed again
    third = CliRunner().invoke(main, ["triage", str(snaps), "-o", str(out), "-j", "1", "--no-verify", "-q"])
    assert third.exit_code == 0 and "(1 from cache)" in third.output, third.output
