"""Golden JSON: each shipped sample's analysis, normalised, must equal tests/golden/<sample>.json.

After an intended change (or new samples), rewrite the golden files and review them with `git diff`:

    NANREPLAY_UPDATE_GOLDEN=1 python -m pytest tests/analysis/test_golden.py

Normalising scrubs what varies from run to run or from checkout to checkout: timings, dates, versions,
absolute paths (the repository root becomes <repo>), and float noise (6 significant digits).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from pathlib import Path

import pytest

from nanreplay.analysis import analyze
from samples import ROOT, SAMPLES, flags, names

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
UPDATE = os.environ.get("NANREPLAY_UPDATE_GOLDEN") == "1"
REPO = "<repo>"
DIGITS = 6  # significant digits kept of every float: the last bits may differ between CPUs
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
    fresh = dump(normalise(analyze(SAMPLES / f"{name}.pt", **flags(name)).to_json()))
    golden = GOLDEN / f"{name}.json"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(fresh)
        return
    if not golden.exists():
        pytest.fail(f"no golden file {golden.relative_to(ROOT)}: write it with NANREPLAY_UPDATE_GOLDEN=1", pytrace=False)
    expected = golden.read_text()
    if fresh != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), fresh.splitlines(True),
                                            f"golden/{name}.json", f"{name} analyzed now", n=2))
        pytest.fail(f"the analysis of {name}.pt differs from its golden file "
                    f"(rewrite with NANREPLAY_UPDATE_GOLDEN=1 if the change is intended):\n{diff}", pytrace=False)


def test_every_golden_file_has_its_sample():
    stale = sorted({p.stem for p in GOLDEN.glob("*.json")} - set(names()))
    if UPDATE:
        for s in stale:
            (GOLDEN / f"{s}.json").unlink()
        return
    assert not stale, f"golden files without a sample (NANREPLAY_UPDATE_GOLDEN=1 removes them): {stale}"
