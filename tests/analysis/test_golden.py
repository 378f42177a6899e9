"""Golden JSON: each shipped sample's analysis, normalised, must match tests/golden/<sample>.json.

What a golden file is for is compared exactly: its structure (every key, every list's length), the verdict,
the culprit, the chain, the diagnosis, the fix and its code, every count, shape, dtype and index. A measured
float is compared with the tolerance that float32 arithmetic guarantees across machines: sums and matmuls
are not bit-stable across CPUs, BLAS code paths (MKL_CBWR, MKL_ENABLE_INSTRUCTIONS) or thread counts, so
values agree to a relative 1e-4, not to the last digit (see `same`).

After an intended change (or new samples), rewrite the golden files and review them with `git diff`:

    NANREPLAY_UPDATE_GOLDEN=1 python -m pytest tests/analysis/test_golden.py

A rewrite keeps a golden file that still matches within the tolerances, so rewriting on another machine
does not churn its last digits. Normalising scrubs what varies from run to run or from checkout to checkout:
timings, dates, versions, absolute paths (the repository root becomes <repo>); floats are stored with
6 significant digits.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from nanreplay.analysis import analyze
from samples import ROOT, SAMPLES, flags, names
from tolerance import same, unrounded

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
UPDATE = os.environ.get("NANREPLAY_UPDATE_GOLDEN") == "1"
REPO = "<repo>"
DIGITS = 6  # significant digits a golden file stores of each float
VERSIONS = ("torch", "python", "platform", "cuda")  # of `environment` and the recorded `snapshot_info.environment`


def _is_source(d: dict) -> bool:
    return {"file", "line", "path"} <= set(d)


def _recorded_roots(x) -> set[str]:
    """Where the sample was recorded: a recorded path minus the local path it maps to."""
    roots = set()
    if isinstance(x, dict):
        rec, path = x.get("recorded_path"), x.get("path")
        if _is_source(x) and rec and path and not os.path.isabs(path) and rec.endswith("/" + path):
            roots.add(rec[: -len(path) - 1])
        for v in x.values():
            roots |= _recorded_roots(v)
    elif isinstance(x, list):
        for v in x:
            roots |= _recorded_roots(v)
    return roots


def _scrub(x, roots: list[str]):
    if isinstance(x, dict):
        if _is_source(x):
            # whether a recorded path maps to a local copy depends on where this checkout is: keep where the
            # code is, as a path below <repo>, and drop the recorded path
            x = {k: v for k, v in x.items() if k != "recorded_path"}
            for k in ("file", "path"):
                if isinstance(x[k], str) and not os.path.isabs(x[k]) and not x[k].startswith("<"):
                    x[k] = f"{ROOT}/{x[k]}"
        return {k: _scrub(v, roots) for k, v in x.items()}
    if isinstance(x, list):
        return [_scrub(v, roots) for v in x]
    if isinstance(x, str):
        for r in roots:
            x = x.replace(r, REPO)
        return x
    if isinstance(x, float):
        return float(f"{x:.{DIGITS}g}")
    return x


def normalise(d: dict) -> dict:
    d = copy.deepcopy(d)
    d["stats"]["timings"] = {k: "<seconds>" for k in d["stats"].get("timings", {})}
    d["nanreplay_version"] = "<version>"
    info = d.get("snapshot_info") or {}
    if "created" in info:
        info["created"] = "<created>"
    if info.get("record_seconds") is not None:
        info["record_seconds"] = "<seconds>"
    for part in (d.get("differential") or {}).values():  # each differential replay's own timing
        if isinstance(part, dict) and part.get("seconds") is not None:
            part["seconds"] = "<seconds>"
    for env in (d.get("environment"), info.get("environment")):
        for k in VERSIONS:
            if env and env.get(k) is not None:
                env[k] = f"<{k}>"
    roots = sorted({str(ROOT)} | _recorded_roots(d), key=len, reverse=True)  # longest first: nested roots
    return _scrub(d, roots)


def dump(d: dict) -> str:
    return json.dumps(d, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


@pytest.fixture
def at_repo_root(monkeypatch):
    """Shown paths are relative to the current folder: analyze from the repository root, as the README does."""
    monkeypatch.chdir(ROOT)
    yield


@pytest.mark.parametrize("name", names())
def test_analysis_matches_the_golden_file(name, at_repo_root):
    # --source names the checkout: recorded paths are shown as its files (never read without it); where the
    # checkout is, the invocation says, and the golden file does not
    d = analyze(SAMPLES / f"{name}.pt", source=[str(ROOT)], **flags(name)).to_json()
    d["invocation"]["source"] = None
    fresh = normalise(d)
    golden = GOLDEN / f"{name}.json"
    expected = json.loads(golden.read_text()) if golden.exists() else None
    differences = same(expected, fresh) if expected is not None else ["no golden file"]
    if UPDATE:
        if differences:  # a file that still matches stays as it is: no churn of last digits between machines
            GOLDEN.mkdir(exist_ok=True)
            golden.write_text(dump(fresh))
        return
    if expected is None:
        pytest.fail(f"no golden file {golden.relative_to(ROOT)}: write it with NANREPLAY_UPDATE_GOLDEN=1", pytrace=False)
    assert not unrounded(fresh), f"prose writes a raw float repr (format it with stats.num): {unrounded(fresh)}"
    if differences:
        pytest.fail(f"the analysis of {name}.pt differs from its golden file beyond what another machine may change "
                    f"(rewrite with NANREPLAY_UPDATE_GOLDEN=1 if the change is intended):\n" + "\n".join(differences),
                    pytrace=False)


def test_every_golden_file_has_its_sample():
    stale = sorted({p.stem for p in GOLDEN.glob("*.json")} - set(names()))
    if UPDATE:
        for s in stale:
            (GOLDEN / f"{s}.json").unlink()
        return
    assert not stale, f"golden files without a sample (NANREPLAY_UPDATE_GOLDEN=1 removes them): {stale}"


def _changed(d: dict, path: str, value) -> dict:
    """A copy of `d` with the value at 'a.b[0].c' replaced (a callable gets the old value)."""
    d = copy.deepcopy(d)
    *parents, last = [int(p) if p.isdigit() else p for p in path.replace("[", ".").replace("]", "").split(".")]
    node = d
    for p in parents:
        node = node[p]
    node[last] = value(node[last]) if callable(value) else value
    return d


# what another machine may change: float32 noise in a reduced value, a rounding boundary in prose
TOLERATED = [
    ("culprit.inputs[0].min", lambda v: v * (1 + 3e-5)),
    ("activations[0].absmax", lambda v: v * (1 - 5e-5)),
    ("diagnosis.fix.verification", lambda s: s.replace("loss 0.05284", "loss 0.05283", 1)),
    ("diagnosis.explanation", lambda s: s.replace("(min -16.14)", "(min -16.13)", 1)),
]
# what the golden file is for: each must fail the comparison
CAUGHT = [
    ("verdict", "not_reproduced"),
    ("culprit.op", "aten.rsqrt.default"),
    ("culprit.inputs[0].negatives", lambda n: n + 1),
    ("culprit.inputs[0].shape", [16, 9]),
    ("culprit.inputs[0].dtype", "float16"),
    ("culprit.inputs[0].min", lambda v: v * (1 + 3e-4)),
    ("chain[0].index", lambda i: i + 1),
    ("chain", lambda c: c[:-1]),
    ("diagnosis.cause", "sqrt_at_zero"),
    ("diagnosis.fix.code", lambda s: s.replace("1e-6", "1e-5")),
    ("diagnosis.fix.verified", lambda b: not b),
    ("diagnosis.explanation", lambda s: s.replace("63 negative", "62 negative", 1)),
    ("diagnosis.explanation", lambda s: s.replace("(min -16.14)", "(min -16.16)", 1)),  # two units: not a rounding
    ("diagnosis.explanation", lambda s: s.replace("anomaly mode", "anomaly-mode", 1)),
    ("culprit.source.line", lambda n: n + 1),
]


def test_the_comparison_tolerates_machine_noise_and_catches_what_the_golden_file_is_for():
    golden = json.loads((GOLDEN / "sqrt_negative.json").read_text())
    golden["diagnosis"]["fix"]["verification"] = "replayed: loss 0.05284, every parameter gradient finite"
    assert "1e-6" in golden["diagnosis"]["fix"]["code"] and "(min -16.14)" in golden["diagnosis"]["explanation"]
    assert same(golden, golden) == []
    for path, change in TOLERATED:
        assert same(golden, _changed(golden, path, change)) == [], path
    for path, change in CAUGHT:
        assert same(golden, _changed(golden, path, change)), path
    extra = _changed(golden, "culprit.op", "aten.sqrt.default")
    extra["culprit"]["new_field"] = 1
    assert same(golden, extra) == [".culprit.new_field: new (not in the golden file)"]
