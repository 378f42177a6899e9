"""Triage names the failing device: transient incidents per host and device, from the snapshots' own records.

The snapshots come from real guarded loops (tests/machines.py) whose guards are told, with the documented
`NanGuard(identity=...)` option, which host and device they run on — as a fleet whose containers' hostnames are not
the nodes' names would; the bit flip makes an incident transient, a NaN of the model's own makes it reproducible.
"""

from __future__ import annotations

import json

from click.testing import CliRunner
from machines import Net, train

from nanreplay.cli import main
from nanreplay.triage.machines import build_machines

# (host, device, run, transient?)
FLEET = [("host-17", "cuda:3", "run-a", True), ("host-17", "cuda:3", "run-b", True),
         ("host-17", "cuda:3", "run-b", False), ("host-9", "cuda:1", "run-c", True)]


def test_triage_names_the_device_with_most_transient_incidents(tmp_path):
    folder = tmp_path / "snaps"
    for i, (host, device, run, transient) in enumerate(FLEET):
        ident = {"host": host, "device": device, "run": run}
        path, _ = (train(folder, identity=ident, flip_at=2, seed=i) if transient else
                   train(folder, identity=ident, model=Net(log=True), seed=i))
        assert path is not None
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["triage", str(folder), "-o", str(out), "--jobs", "1", "--markdown",
                                    str(tmp_path / "t.md")])
    assert res.exit_code == 0, res.output
    top = "cuda:3 on host-17: 2 of 3 transient incidents in 2 runs; 3 incidents there in all"
    assert top in res.output  # the command's own summary line
    doc = json.loads((out / "groups.json").read_text())
    m = doc["machines"]
    assert m["transient"] == 3 and m["checked"] == 4
    assert [(d["device"], d["host"], d["transient"], d["runs"]) for d in m["devices"]] == \
        [("cuda:3", "host-17", 2, 2), ("cuda:1", "host-9", 1, 1)]
    assert top in (out / "index.html").read_text() and top in (tmp_path / "t.md").read_text()


def _row(host, device, run, verdict, *, rank=0, dup=""):
    return {"status": "analyzed", "machine_verdict": verdict, "host": host, "device": device, "run": run,
            "rank": rank, "file": f"{host}-{device}-{run}.pt", "report": "r.html", "duplicate_of": dup}


def test_the_aggregation_is_pure_over_rows_and_counts_a_copy_once():
    rows = [_row("host-17", "cuda:3", r, "transient", rank=3) for r in ("a", "b", "c", "c")]
    rows += [_row("host-17", "cuda:3", "d", "reproducible"), _row("host-2", "cuda:0", "e", "transient"),
             _row("host-17", "cuda:3", "c", "transient", dup="host-17-cuda:3-c.pt"),  # the same bytes again
             _row("host-2", "cuda:0", "f", "skipped"), {"status": "failed", "file": "x.pt"}]
    m = build_machines(rows)
    assert m["devices"][0]["sentence"] == "cuda:3 on host-17: 4 of 5 transient incidents in 3 runs; 5 incidents " \
                                          "there in all"
    assert m["devices"][0]["ranks"] == [3] and m["checked"] == 6
    assert build_machines([_row("h", "cpu", "a", "skipped")]) is None
