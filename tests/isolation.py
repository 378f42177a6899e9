"""For the trainer-integration tests (tests/integrations): the training code lives in a file of its own (so that its source
lines are recorded as a user's), and every snapshot is analyzed in a subprocess where neither that file nor
any training framework can be imported."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torchmetrics",
              "transformers", "accelerate", "huggingface_hub", "tokenizers", "safetensors")

ANALYZE = r'''
import importlib.abc, json, sys

BLOCKED = set(sys.argv[1].split(","))


class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not importable here")
        return None


sys.meta_path.insert(0, Blocked())
for name in sorted(BLOCKED):
    try:
        __import__(name)
    except ImportError:
        continue
    raise SystemExit(f"{name} is importable: the test would prove nothing")
from nanreplay.analysis import analyze

out = {p: analyze(p).to_json() for p in sys.argv[2:]}
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
if leaked:
    raise SystemExit(f"the analysis imported {leaked}")
print(json.dumps(out))
'''


def framework(name: str) -> ModuleType:
    """The framework, or a skip where it is not installed. CI installs the `test` extra, which holds every
    framework: there a missing one is a failure, never a silent skip."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name)


def load_training_code(folder: Path, name: str, code: str) -> ModuleType:
    """Write the training code to folder/name.py and import it from there (as a user's script would be)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def marker_line(code: str, marker: str) -> int:
    return next(i for i, ln in enumerate(code.splitlines(), 1) if ln.rstrip().endswith(f"# LINE: {marker}"))


def analyze_isolated(paths: list[str], workdir: Path, also_blocked: tuple[str, ...] = ()) -> dict[str, dict]:
    """`analyze()` of each snapshot in a fresh python that cannot import the frameworks or the training code."""
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "analyze_isolated.py"
    script.write_text(ANALYZE)
    blocked = ",".join(FRAMEWORKS + also_blocked)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(script), blocked, *paths], cwd=workdir, capture_output=True, text=True,
                         timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


ANALYZE_WITHOUT_TRAINMOD = r'''
import json, sys
try:
    __import__("trainmod")
    raise SystemExit("the training code must not be importable here")
except ImportError:
    pass
from nanreplay.analysis import analyze
print(json.dumps({p: analyze(p).to_json() for p in sys.argv[1:]}))
'''


def program_ops(path: str) -> set[str]:
    """The ops of the step program a snapshot holds (it must hold one)."""
    import torch

    snap = torch.load(path, weights_only=True)
    assert snap["step_program"] is not None, snap.get("program_error")
    return {n["op"] for n in json.loads(snap["step_program"])["nodes"]}


def train_then_analyze(root: Path, training: str, kinds,
                       analyze_script: str = ANALYZE_WITHOUT_TRAINMOD) -> dict[str, tuple[str, dict]]:
    """Run `training` as root/proj/trainmod.py with `root` and `kinds` as arguments (it prints `KIND PATH` per
    snapshot), then `analyze_script` from root/elsewhere with those paths (it prints one JSON object keyed by
    path), the training code not importable there. Returns {kind: (path, its analysis)}."""
    proj, elsewhere = root / "proj", root / "elsewhere"
    proj.mkdir()
    elsewhere.mkdir()
    (proj / "trainmod.py").write_text(training)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "trainmod.py", str(root), *kinds], cwd=proj, capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    paths = dict(ln.split() for ln in res.stdout.splitlines() if ln.split() and ln.split()[0] in kinds)
    assert set(paths) == set(kinds) and all(p.endswith(".pt") for p in paths.values()), res.stdout
    (elsewhere / "analyze_it.py").write_text(analyze_script)
    res = subprocess.run([sys.executable, "analyze_it.py", *paths.values()], cwd=elsewhere, capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    return {k: (paths[k], out[paths[k]]) for k in kinds}


def apply_edits(path: Path, edits: list[dict]) -> None:
    """Each edit's `before` statement (its lines, indent removed) replaced in the file by its `after`, indented where
    it was: a fix applied as a user would apply it."""
    for e in edits:
        lines = path.read_text().splitlines(keepends=True)
        want = [x.strip() for x in e["before"].splitlines()]
        at = next((i for i in range(len(lines)) if [x.strip() for x in lines[i:i + len(want)]] == want), None)
        assert at is not None, f"not in the training code: {e['before']!r}"
        indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
        lines[at:at + len(want)] = [indent + x + "\n" for x in e["after"].splitlines()]
        path.write_text("".join(lines))


def apply_and_train(folder: Path, training: str, script: str, kind: str, fix: dict, *, bad: int, env: dict,
                    coarse: bool = False, changes_model: bool = False) -> list:
    """Judge a fix by applying it: put the shown `after` in place of `before` in a copy of the training file
    (`training`, run as `script`.py: `--plain KIND` trains it plainly and prints {kind: [(loss, grad norm)...]},
    `--f64 KIND` the same in float64); the fixed run is finite at every step, the original is not at step `bad`,
    and the healthy steps before it are the original's — or, where the original computes in a coarse dtype
    (`coarse`: bfloat16), at least as close as the original's to the same loop in float64. A fix that changes the
    model by design (`changes_model`: relu -> softplus) is not held to the healthy steps' values. Returns the
    fixed run's (loss, gradient norm) per step."""
    import math

    from tolerance import close

    src = training.splitlines()
    for edit in fix.get("edits") or [fix]:  # every line the fix changes
        before, after = edit["before"].splitlines(), edit["after"].splitlines()
        at = next(i for i in range(len(src)) if all(src[i + j].strip().startswith(b.strip().split("  #")[0])
                                                     for j, b in enumerate(before)))
        indent = src[at][:len(src[at]) - len(src[at].lstrip())]
        src[at:at + len(before)] = [indent + a for a in after]
    folder.mkdir()
    (folder / f"{script}.py").write_text("\n".join(src) + "\n")
    (folder / "original.py").write_text(training)
    got = {}
    for name, mode in ((script, "--plain"), ("original", "--plain"), ("original", "--f64"))[:3 if coarse else 2]:
        res = subprocess.run([sys.executable, f"{name}.py", mode, kind], cwd=folder, capture_output=True,
                             text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        got[name + mode] = json.loads(res.stdout)[kind]
    fixed, orig = got[f"{script}--plain"], got["original--plain"]
    assert len(fixed) == len(orig), (fixed, orig)
    assert all(math.isfinite(v) for st in fixed for v in st), fixed
    assert not all(math.isfinite(v) for v in orig[bad]), orig  # the original does fail at that step
    for k in range(0 if changes_model else bad):  # the healthy steps before it: the same loss and gradient norm
        if coarse:
            ref = got["original--f64"][k]
            assert all(abs(a - r) <= abs(b - r) * 1.01 + 1e-6 * abs(r) for a, b, r in zip(fixed[k], orig[k], ref,
                                                                                          strict=True)), \
                (k, fixed[k], orig[k], ref)
        else:
            assert close(fixed[k][0], orig[k][0]) and close(fixed[k][1], orig[k][1]), (k, fixed[k], orig[k])
    return fixed


def train_and_analyze_isolated(root: Path, module: str, training: str, kinds, env: dict) -> dict[str, dict]:
    """Run `training` as root/proj/<module>.py with `root` and `kinds` as arguments under `env` (it prints
    `KIND PATH` per snapshot), then `analyze()` each snapshot where neither the frameworks nor that module can be
    imported (analyze_isolated). Returns {kind: its analysis}."""
    proj = root / "proj"
    proj.mkdir()
    (proj / f"{module}.py").write_text(training)
    res = subprocess.run([sys.executable, f"{module}.py", str(root), *kinds], cwd=proj, capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    paths = dict(ln.split() for ln in res.stdout.splitlines() if ln.split() and ln.split()[0] in kinds)
    assert set(paths) == set(kinds) and all(p.endswith(".pt") for p in paths.values()), res.stdout
    out = analyze_isolated(list(paths.values()), root / "elsewhere", also_blocked=(module,))
    return {k: out[paths[k]] for k in kinds}


def guard_invisible(train, tmp_path: Path, steps: int):
    """`train(folder, guarded, bad_step) -> (losses, model, guard)` run healthy without and with the guard: the same
    `steps` losses and the same weights, bitwise (same machine, same computation). The guarded run's guard."""
    import torch

    plain, m0, _ = train(tmp_path / "off", False, None)
    guarded, m1, guard = train(tmp_path / "on", True, None)
    assert len(plain) == steps and all(torch.equal(a, b) for a, b in zip(plain, guarded, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters(), strict=True))
    return guard
