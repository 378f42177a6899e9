"""Crafted and hostile snapshots, written by these tests: each is refused with one line, runs no code,
writes nothing outside the outputs and discloses no local file.

The list (docs/safety.md states the guarantees these prove):
pickles in every place a snapshot holds objects (top level, batch, constants, optimizer state, a legacy
non-zip file), a version-1 snapshot whose embedded torch.export archive carries a pickle, step programs
with a symbolic size, a file-reading op (`from_file`), storage/stride tricks, unknown and custom ops,
strings where none may be, refs used before they exist, non-standard JSON, a shape the file lies about,
a graph that would allocate far more than the memory limit, frames naming /etc/shadow and a local
settings.py, the zero device and a FIFO as the snapshot path.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from crafting import LogNet, node_of, save, valid_snapshot, with_program

from nanreplay.analysis import analyze
from nanreplay.cli import main
from nanreplay.errors import ModelError, SnapshotError, TrustError, UsageError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def valid(tmp_path) -> tuple[Path, dict]:
    """A real native snapshot (a log of zero) and its loaded dict, to mutate."""
    return valid_snapshot(tmp_path)


class Boom:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _cli(*args: str, cwd: Path | None = None):
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        r = CliRunner().invoke(main, list(args))
    finally:
        os.chdir(old)
    return r.exit_code, r.stdout, r.stderr


def _one_line(code: int, out: str, err: str, *words: str) -> None:
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err and err.strip().count("\n") == 0, err
    for w in words:
        assert w in err, err


# ---------------------------------------------------------------- pickles anywhere


@pytest.mark.parametrize("where", ["top", "batch", "constants", "optimizer", "legacy"])
def test_a_pickle_anywhere_never_runs(valid, tmp_path, where):
    _, d = valid
    marker = tmp_path / "pwned"
    boom = Boom(marker)
    kw = {}
    if where == "top":
        d["extra"] = boom
    elif where == "batch":
        d["batch"]["target"] = [boom]
    elif where == "constants":
        d["constants"] = {"c0": boom}
    elif where == "optimizer":
        d["optimizer"] = {"class": "SGD", "state_dict": {"state": {0: boom}}}
    else:
        d["extra"] = boom
        kw["_use_new_zipfile_serialization"] = False
    p = save(d, tmp_path / f"evil_{where}.pt", **kw)
    with pytest.raises(TrustError, match="--trust"):
        analyze(p)
    _one_line(*_cli("analyze", str(p), "-o", str(tmp_path / "r.html")), "refusing", "--trust")
    assert not marker.exists() and not (tmp_path / "r.html").exists()


def test_version_1_export_archive_is_never_opened(tmp_path):
    """nanreplay 0.1 embedded a torch.export archive; loading one can unpickle. It is never touched."""
    import pickle

    marker = tmp_path / "pwned"
    payload = pickle.dumps(Boom(marker))
    model = LogNet()
    d = {"format": "nanreplay.snapshot", "version": 1, "batch": {"inputs": torch.zeros(2, 4), "target": None},
         "model_state": model.state_dict(), "loss_spec": {"kind": "output"},
         "model": {"exported": torch.frombuffer(bytearray(payload), dtype=torch.uint8), "factory": "os:system"}}
    p = save(d, tmp_path / "v1.pt")
    for trust in (False, True):
        with pytest.raises(ModelError, match="re-capture"):
            analyze(p, trust=trust)
    assert not marker.exists()


# ---------------------------------------------------------------- step programs


CRAFTED = {
    "symbolic size": (lambda p: p["leaves"][0].__setitem__("shape", ["s0*2", 3]), "shape"),
    "sympy expression": (lambda p: node_of(p, "aten.addmm.default")["meta"][0].__setitem__(
        0, "__import__('os').system('touch /tmp/x')"), "meta"),
    "from_file": (lambda p: p["nodes"].insert(0, {"op": "aten.from_file.default", "args": ["/etc/shadow", True, 100],
                                                  "out": 999, "meta": [[[100], "uint8"]]}), "allowlist"),
    "set_ storage": (lambda p: node_of(p, "aten.addmm.default").__setitem__("op", "aten.set_.source_Storage"),
                     "allowlist"),
    "as_strided": (lambda p: node_of(p, "aten.addmm.default").__setitem__("op", "aten.as_strided.default"),
                   "allowlist"),
    "_copy_from": (lambda p: node_of(p, "aten.addmm.default").__setitem__("op", "aten._copy_from.default"),
                   "allowlist"),
    "unknown op": (lambda p: node_of(p, "aten.addmm.default").__setitem__("op", "aten.not_an_op.default"),
                   "allowlist"),
    "custom op": (lambda p: node_of(p, "aten.addmm.default").__setitem__("op", "mylib.evil.default"), "allowlist"),
    "collective": (lambda p: node_of(p, "aten.addmm.default").__setitem__("op", "_c10d_functional.all_reduce.default"),
                   "allowlist"),
    "string argument": (lambda p: node_of(p, "aten.addmm.default")["args"].__setitem__(0, "/etc/passwd"),
                        "argument"),
    "ref before use": (lambda p: node_of(p, "aten.addmm.default")["args"].__setitem__(0, {"r": 10**6}),
                       "before it is defined"),
    "unknown node key": (lambda p: node_of(p, "aten.addmm.default").__setitem__("exec", "print(1)"), "unknown keys"),
    "wrong schema": (lambda p: p.__setitem__("schema", "nanreplay.step/99"), "schema"),
    "lying shape": (lambda p: node_of(p, "aten.addmm.default")["meta"][0].__setitem__(0, [5, 300]), "declares shape"),
    "leaf shape": (lambda p: p["leaves"][0].__setitem__("shape", [4, 40]), "the program says"),
}


@pytest.mark.parametrize("name", CRAFTED)
def test_crafted_step_programs_are_refused(valid, tmp_path, name):
    _, d = valid
    edit, words = CRAFTED[name]
    p = save(with_program(d, edit), tmp_path / "crafted.pt")
    with pytest.raises(SnapshotError, match=words):
        analyze(p)
    code, out, err = _cli("analyze", str(p), "-o", str(tmp_path / "r.html"))
    _one_line(code, out, err, "invalid step program")
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("text", ['{"schema": NaN}', '{"schema": "a", "schema": "b"}', "[1, 2", '{"a": Infinity}'])
def test_non_standard_json_is_refused(valid, tmp_path, text):
    _, d = valid
    d["step_program"] = text
    p = save(d, tmp_path / "json.pt")
    with pytest.raises(SnapshotError, match="invalid step program"):
        analyze(p)


def test_a_graph_that_needs_more_memory_than_the_limit_is_refused_before_it_runs(valid, tmp_path):
    _, d = valid

    def huge(prog):
        prog["nodes"].insert(0, {"op": "aten.zeros.default", "args": [[200_000, 200_000]],
                                 "kwargs": {"dtype": {"dtype": "float32"}}, "out": 10**6,
                                 "meta": [[[200_000, 200_000], "float32"]]})
    p = save(with_program(d, huge), tmp_path / "huge.pt")
    with pytest.raises(UsageError, match=r"needs about .* GiB .* more than --max-memory"):
        analyze(p, max_memory=2**30)
    # the honest step fits easily
    assert analyze(valid[0], max_memory=2**30, verify=False).verdict == "culprit_found"


def test_copy_into_a_parameter_writes_no_file(valid, tmp_path):
    """copy_ is allowed (tensor to tensor); with from_file denied it cannot reach the file system."""
    _, d = valid

    def copy_in(prog):
        w = next(lf for lf in prog["leaves"] if lf["name"] == "fc.weight")
        first = prog["nodes"][0]
        prog["nodes"].insert(0, {"op": "aten.zeros_like.default", "args": [{"r": w["ref"]}], "out": 10**6,
                                 "meta": [[w["shape"], "float32"]]})
        prog["nodes"].insert(1, {"op": "aten.copy_.default", "args": [{"r": 10**6}, {"r": w["ref"]}],
                                 "out": 10**6 + 1, "meta": [[w["shape"], "float32"]]})
        assert first
    p = save(with_program(d, copy_in), tmp_path / "copy.pt")
    before = set(tmp_path.rglob("*"))
    analyze(p, verify=False)
    assert set(tmp_path.rglob("*")) == before


# ---------------------------------------------------------------- frames that name local files


def test_frames_naming_local_files_disclose_nothing(valid, tmp_path):
    _, d = valid
    work = tmp_path / "work"
    work.mkdir()
    (work / "settings.py").write_text("import os\nSECRET_KEY = 'hunter2-do-not-leak'\nDB = 'x'\n")
    shadow_secret = None
    if os.access("/etc/shadow", os.R_OK):
        first = Path("/etc/shadow").read_text().splitlines()
        shadow_secret = next((ln for ln in first if ln.count(":") > 2 and len(ln.split(":")[1]) > 3), None)

    def frames(prog):
        prog["frames"] = [{"file": "/etc/shadow", "line": 1, "function": "forward", "code": None},
                          {"file": "/home/alice/proj/settings.py", "line": 1, "function": "forward",
                           "code": "import os", "context": [1, ["import os"]]},
                          {"file": str(work / "settings.py"), "line": 2, "function": "forward", "code": ""}]
        for i, n in enumerate(prog["nodes"]):
            n["frame"] = i % 3
    p = save(with_program(d, frames), tmp_path / "frames.pt")
    code, out, err = _cli("analyze", str(p), "-o", str(work / "r.html"), "--json", str(work / "r.json"), cwd=work)
    assert code == 0, err
    everything = out + err + (work / "r.html").read_text() + (work / "r.json").read_text()
    assert "hunter2" not in everything and "SECRET_KEY" not in everything
    if shadow_secret:
        assert shadow_secret.split(":")[1] not in everything
    assert sorted(x.name for x in work.iterdir()) == ["r.html", "r.json", "settings.py"]


# ---------------------------------------------------------------- special files as the snapshot


def test_the_zero_device_is_not_a_snapshot(tmp_path):
    _one_line(*_cli("analyze", "/dev/zero", "-o", str(tmp_path / "r.html")), "not a regular file")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "snap.pt"
    os.mkfifo(fifo)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", _cli("analyze", str(fifo), "-o",
                                                                       str(tmp_path / "r.html"))))
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "analyze blocked on a FIFO"
    _one_line(*result["r"], "not a regular file")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # left as it was


# ---------------------------------------------------------------- every field, every wrong type


WRONG = {"str": "x", "list": [1, 2], "nan": float("nan"), "dict": {"a": 1}, "tensor": torch.zeros(3),
         "bool": True, "int": 7, "dtype": torch.float16, "none": None, "bigstr": "y" * 100_000}


def test_every_field_of_a_native_snapshot_with_every_wrong_type_is_one_line(valid, tmp_path):
    """A property-style sweep: any field of a valid snapshot, turned into any wrong type, is either still
    analyzable or refused with one line and exit 2 — never a traceback."""
    path, d = valid
    seen = 0
    for field in sorted(d):
        for label, value in WRONG.items():
            bad = dict(d)
            bad[field] = value
            p = tmp_path / "mut.pt"
            torch.save(bad, p)
            # in this process: the sweep checks the parser's refusals (the same code runs in the confined child,
            # whose error channel tests/confine checks); a child per mutation would cost ~150 torch imports
            code, out, err = _cli("analyze", str(p), "-o", str(tmp_path / "m.html"), "--no-verify", "--no-confine")
            assert "Traceback" not in out + err, (field, label, err)
            assert code in (0, 1, 2), (field, label, code, err)
            if code != 0:
                assert err.strip().count("\n") == 0, (field, label, err)
            seen += 1
    assert seen == len(d) * len(WRONG)


def test_schema_errors_name_the_field(valid, tmp_path):
    _, d = valid
    for field, value, words in [("step", "12", "step must be an integer"), ("batch", [1], "batch must be a dict"),
                                ("state", {"fc.weight": "w"}, "state['fc.weight'] must be a tensor"),
                                ("rng", "abc", "rng must be a dict"), ("grad_scale", [2.0], "grad_scale must be a number"),
                                ("autocast", {"dtype": "float99"}, "autocast.dtype must be one of")]:
        bad = dict(d)
        bad[field] = value
        p = save(bad, tmp_path / "f.pt")
        with pytest.raises(SnapshotError, match=words.replace("[", r"\[").replace("]", r"\]")):
            analyze(p)


# ---------------------------------------------------------------- never NanReplay's own files


def test_hostile_snapshot_in_a_fresh_process_runs_no_code(tmp_path):
    """The same refusal from a separate interpreter with only the repository on its path."""
    marker = tmp_path / "pwned"
    p = tmp_path / "evil.pt"
    torch.save({"format": "nanreplay.snapshot", "version": 2, "x": Boom(marker)}, p)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "nanreplay.cli", "analyze", str(p)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and not marker.exists()
