"""Crafting hostile snapshots for the trust tests (tests/formats/test_crafted*.py).

A real native snapshot (`valid_snapshot`: a log of zero, recorded by NanGuard) is the starting point; a
crafted file edits its step program (`with_program`) or inserts nodes that read tensors the file stores
(`with_nodes`). `run_cli_cases` analyzes many crafted files in one child interpreter that reports each
case as it finishes: a kernel that crashes the interpreter fails that case, never pytest.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn

from nanreplay import NanGuard

ROOT = Path(__file__).resolve().parents[1]
BASE_REF = 900_000  # refs of inserted leaves and nodes: far above what the real program uses


class LogNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.log(torch.relu(self.fc(x))).mean()


def valid_snapshot(folder: Path) -> tuple[Path, dict]:
    """A real native snapshot (a log of zero) and its loaded dict, to mutate."""
    torch.manual_seed(0)
    model = LogNet()
    guard = NanGuard(model, folder=folder / "snaps")
    x = -torch.ones(5, 4) * 10
    guard.begin(x)
    assert not guard.loss_ok(model(x))
    path = Path(guard.last_snapshot)
    return path, torch.load(path, weights_only=True)


def save(d: dict, path: Path, **kw) -> Path:
    torch.save(d, path, **kw)
    return path


def with_program(d: dict, edit) -> dict:
    prog = json.loads(d["step_program"])
    edit(prog)
    d["step_program"] = json.dumps(prog)
    return d


def node_of(prog: dict, op: str) -> dict:
    return next(n for n in prog["nodes"] if n["op"] == op)


class R:
    """A reference, in a crafted node, to a stored tensor (by its name in `tensors`) or to an earlier crafted
    node's output (by its index)."""

    def __init__(self, name: str | int, k: int = 0):
        self.name, self.k = name, k


def with_nodes(d: dict, tensors: dict[str, torch.Tensor], nodes: list[tuple]) -> dict:
    """Insert, before the real step, nodes (op, args, kwargs, [[shape, dtype], ...]) that read `tensors`
    (stored as the snapshot's constants); an output list of one ref per declared meta entry."""
    prog = json.loads(d["step_program"])
    refs = {}
    consts = dict(d.get("constants") or {})
    for i, (name, t) in enumerate(tensors.items()):
        refs[name] = BASE_REF + i
        consts[f"crafted_{name}"] = t
        prog["leaves"].append({"ref": refs[name], "kind": "constant", "name": f"crafted_{name}",
                               "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")})
    outs: list[list[int]] = []

    def enc(v):
        if isinstance(v, R):
            return {"r": refs[v.name] if isinstance(v.name, str) else outs[v.name][v.k]}
        if isinstance(v, list):
            return [enc(x) for x in v]
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        return v

    crafted = []
    for j, (op, args, kwargs, meta) in enumerate(nodes):
        out = [BASE_REF + 5000 + 10 * j + k for k in range(len(meta))]
        crafted.append({"op": op, "args": enc(list(args)), "kwargs": {k: enc(v) for k, v in kwargs.items()},
                        "out": out if len(out) != 1 else out[0], "meta": meta})
        outs.append(out)
    prog["nodes"][:0] = crafted
    d["constants"] = consts
    d["step_program"] = json.dumps(prog)
    return d


# ---------------------------------------------------------------- analysis in a child interpreter

_WORKER = r'''
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
from click.testing import CliRunner
from nanreplay.cli import main
for line in sys.stdin:
    case = json.loads(line)
    print(json.dumps({"start": case["name"]}), flush=True)
    os.chdir(case["cwd"])
    r = CliRunner().invoke(main, case["args"])
    err = r.stderr if r.stderr is not None else ""
    tb = "" if r.exception is None or isinstance(r.exception, SystemExit) else repr(r.exception)[:300]
    print(json.dumps({"name": case["name"], "code": r.exit_code, "out": r.stdout, "err": err, "exc": tb}), flush=True)
'''


def run_cli_cases(cases: list[dict], *, timeout: float = 900) -> dict[str, dict]:
    """Each case {"name", "cwd", "args"}: `nanreplay ARGS` in one child interpreter (restarted after a crash).
    Returns name -> {"code", "out", "err", "exc"}; a case that killed the child has "signal"."""
    results: dict[str, dict] = {}
    todo = list(cases)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    while todo:
        feed = "".join(json.dumps(c) + "\n" for c in todo)
        res = subprocess.run([sys.executable, "-c", _WORKER], input=feed, capture_output=True, text=True,
                             timeout=timeout, env=env, cwd=str(ROOT))
        started = None
        for line in res.stdout.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "start" in msg:
                started = msg["start"]
            else:
                results[msg["name"]] = msg
                started = None
        if started is not None:  # the child died in this case
            results[started] = {"code": None, "signal": -res.returncode, "out": "", "err": res.stderr[-2000:],
                                "exc": ""}
        done = set(results)
        rest = [c for c in todo if c["name"] not in done]
        if len(rest) == len(todo):  # no progress: report the child's end for all the rest
            for c in rest:
                results[c["name"]] = {"code": None, "signal": -res.returncode, "out": "", "err": res.stderr[-2000:],
                                      "exc": ""}
            break
        todo = rest
    return results


MEMORY_WORD = re.compile(r"\d{10,}")  # a number as long as a heap word or pointer


def analyze_crafted(folder: Path, cases: dict) -> dict[str, dict]:
    """Each case's build (name -> (build, words)) applied to a copy of one valid snapshot and analyzed by the CLI,
    unconfined (the checks must hold without the sandbox), JSON to `c{i}.json`, no report: the CLI's results."""
    _, base = valid_snapshot(folder / "v")
    runs = []
    for i, (name, (build, _)) in enumerate(cases.items()):
        d = {**base, "batch": dict(base["batch"]), "constants": dict(base.get("constants") or {})}
        path = save(build(d), folder / f"c{i}.pt")
        runs.append({"name": name, "cwd": str(folder), "args": ["analyze", str(path), "--no-confine", "--json",
                                                                 str(folder / f"c{i}.json"), "--no-report"]})
    return run_cli_cases(runs)


def assert_one_line_refusal(r: dict, *words: str, code: int = 2) -> str:
    """Exit `code`, no signal, no traceback, one line on stderr holding every word and no memory word."""
    assert r.get("signal") is None, f"killed by signal {r.get('signal')}: {r['err'][-500:]}"
    assert r["code"] == code, r
    assert not r["exc"] and "Traceback" not in r["out"] + r["err"], r
    err = r["err"].strip()
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)
    assert not MEMORY_WORD.search(err), err
    return err
