"""The confined child (nanreplay/confine/): it really cannot read the analyst's files, create a file or open a
socket; a crash, a memory-limit hit and a timeout in it are one line; `analyze` and `triage` use it by default
and their results are the unconfined ones."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clirun import one_line_error, run
from crafting import LogNet

from nanreplay import NanGuard, confine
from nanreplay.confine import filters
from nanreplay.errors import ConfinedCrash, LimitError
from tolerance import same

ROOT = Path(__file__).resolve().parents[2]
PROBE = str(Path(__file__).with_name("probe.py"))
SAMPLE = ROOT / "sample_snapshots" / "sqrt_zero.pt"

no_landlock = pytest.mark.skipif(filters.landlock_abi() is None, reason="this kernel has no Landlock (Linux >= 5.13, "
                                 "enabled in the LSM list): files are not filtered here")
no_seccomp = pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"),
                                reason="no seccomp socket filter for this machine")


def _job(tmp_path: Path, probe: str, **kw) -> dict:
    snap = tmp_path / "in" / "snap.pt"
    snap.parent.mkdir(exist_ok=True)
    snap.write_bytes(b"a snapshot")
    return {"path": str(snap), "shown": "snap.pt", "probe": probe, "max_memory": 1 << 30, **kw}


@pytest.fixture
def listeners():
    """A TCP port on 127.0.0.1 and ::1 and an abstract UNIX socket that accept connections (outside the sandbox)."""
    tcp = socket.create_server(("127.0.0.1", 0))
    port = tcp.getsockname()[1]
    socks = [tcp]
    try:
        socks.append(socket.create_server(("::1", port), family=socket.AF_INET6))
    except OSError:
        pass
    unix = socket.socket(socket.AF_UNIX)
    unix.bind("\0nanreplay-test")
    unix.listen()
    socks.append(unix)
    yield port
    for s in socks:
        s.close()


@no_landlock
@no_seccomp
def test_the_child_cannot_read_the_analysts_files_create_a_file_or_connect(tmp_path, listeners, monkeypatch):
    secret = tmp_path / "settings.py"
    secret.write_text("API_KEY = 'x'\n")
    job = _job(tmp_path, "escape")
    reads = {"snapshot": job["path"], "cwd_file": str(secret), "etc": "/etc/passwd",
             "home": str(Path(__file__))}
    # the control: outside the sandbox each of these works, so a denial below is the sandbox's
    for path in reads.values():
        Path(path).read_bytes()
    socket.create_connection(("127.0.0.1", listeners), timeout=2).close()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "analyst's")
    d = confine.run({**job, "reads": reads, "writable": str(tmp_path), "port": listeners},
                    entry=PROBE)
    got = d["attempts"]
    assert got["snapshot"] == "read"
    assert all(got[k].startswith("denied") for k in ("cwd_file", "etc", "home", "create")), got
    assert all(got[k].startswith("denied") for k in ("AF_INET", "AF_INET6", "AF_UNIX")), got
    assert not (tmp_path / "created").exists()
    env = d["environment"]
    assert env["cwd"] != str(tmp_path) and not os.path.exists(env["cwd"])  # its own folder, removed after
    inherited = set(env["env"]) & set(os.environ)  # (torch's import sets a variable or two of its own)
    assert "AWS_SECRET_ACCESS_KEY" not in env["env"] and inherited <= set(confine.minimal_env("/")), inherited
    # stdin/out/err (/dev/null), the result pipe, the progress page and what torch's import opened: nothing else
    assert {k: v for k, v in env["fds"].items() if v.startswith("/") and not v.startswith(("/dev/null", "/memfd:"))
            and not any(v.startswith(p) for p in filters.python_reads())} == {}, env["fds"]
    c = env["confinement"]
    assert c["process"] and c["landlock"].startswith("abi ") and c["seccomp"] is True and c["lost"] is None
    assert c["rlimits"]["core"] == 0 and c["rlimits"]["fsize"] == 0 and c["rlimits"]["as"] > 1 << 30


def test_a_signal_in_the_child_names_the_op_and_node(tmp_path):
    with pytest.raises(ConfinedCrash) as e:
        confine.run(_job(tmp_path, "segv"), entry=PROBE)
    assert str(e.value) == ("snap.pt: the snapshot's step crashed torch's `aten.embedding_dense_backward.default` "
                            "kernel at node 7 (SIGSEGV in the replay; a crafted or corrupt snapshot); nothing was written")
    assert e.value.exit_code == 2


def test_the_address_space_limit_is_one_line(tmp_path):
    with pytest.raises(LimitError, match=r"ran out of memory under --max-memory 64 MiB"):
        confine.run(_job(tmp_path, "memory", max_memory=64 << 20), entry=PROBE)


# ---------------------------------------------------------------- the commands


@pytest.fixture
def crashing(tmp_path) -> Path:
    """A real snapshot whose step program casts to dtype code 200: torch's `to` kernel segfaults on it (in the dry
    run), unless validation refuses the code first."""
    torch.manual_seed(0)
    model = LogNet()
    guard = NanGuard(model, folder=tmp_path / "snaps")
    x = -torch.ones(5, 4) * 10
    guard.begin(x)
    assert not guard.loss_ok(model(x))
    d = torch.load(guard.last_snapshot, weights_only=True)
    prog = json.loads(d["step_program"])
    prog["nodes"].insert(1, {"op": "aten.to.prim_dtype", "args": [{"r": prog["nodes"][0]["out"]}, 200], "out": 999,
                             "meta": [[[5, 3], "float32"]]})
    d["step_program"] = json.dumps(prog)
    (tmp_path / "in").mkdir()
    torch.save(d, tmp_path / "in" / "bad.pt")
    return tmp_path / "in" / "bad.pt"


def test_a_kernel_crash_is_one_line_and_writes_nothing(crashing, tmp_path):
    res = run("analyze", crashing, "-o", tmp_path / "r.html", "--json", tmp_path / "r.json")
    err = one_line_error(res, 2, "aten.to.prim_dtype", "node 1")  # crashed in the child, or refused before it
    assert "crashed torch's `aten.to.prim_dtype` kernel at node 1" in err or "invalid step program" in err
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "r.json").exists()


def test_triage_lists_a_crash_and_analyzes_the_rest(crashing, tmp_path):
    (crashing.parent / "good.pt").write_bytes(SAMPLE.read_bytes())
    res = run("triage", crashing.parent, "-o", tmp_path / "out", "-j", "1")
    assert res.exit_code == 1, res.output
    doc = json.loads((tmp_path / "out" / "groups.json").read_text())
    (bad,) = doc["failures"]  # a crash (the kernel's undefined behaviour may also just raise) or a refusal
    assert bad["file"] == "bad.pt" and "aten.to.prim_dtype" in bad["reason"] and "node 1" in bad["reason"], bad
    assert [g["count"] for g in doc["groups"]] == [1]
    good = json.loads((tmp_path / "out" / "good.json").read_text())
    assert good["verdict"] == "culprit_found" and good["environment"]["confinement"]["process"] is True
    assert not (tmp_path / "out" / "bad.html").exists()


def test_the_confined_analysis_is_the_unconfined_one(tmp_path):
    # (in a folder without the model's source: an unconfined analysis would match local files under the cwd)
    a = run("analyze", SAMPLE, "-o", tmp_path / "a.html", "--json", tmp_path / "a.json", cwd=tmp_path)
    b = run("analyze", SAMPLE, "-o", tmp_path / "b.html", "--json", tmp_path / "b.json", "--no-confine", cwd=tmp_path)
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    ja, jb = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    state = ja["environment"].pop("confinement")
    assert state["process"] is True and "confinement" not in jb["environment"]
    for j in (ja, jb):
        j["stats"].pop("timings")
        j["invocation"].pop("source", None)
        (j.get("differential") or {}).get("machine", {}).pop("seconds", None)  # a timing too (the re-run's check)
    # the child runs torch with its own thread count (the test process is pinned by conftest): float reductions
    # may differ in their last bits on another math-library path (ATEN_CPU_CAPABILITY=default), nothing else
    assert same(ja, jb) == []


def test_timeout_kills_the_child(tmp_path):
    (tmp_path / "s.pt").write_bytes(SAMPLE.read_bytes())  # its path is in the child's command line
    code = "from nanreplay.cli import main; main(['analyze', 's.pt', '-o', 'r.html', '--timeout', '0.5'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1 and "--timeout" in out.stderr and "Traceback" not in out.stderr, out.stderr
    left = subprocess.run(["pgrep", "-f", f"nanreplay.confine.*{tmp_path.name}"], capture_output=True, text=True)
    assert left.stdout == "", "the confined child outlived its parent"
    assert not (tmp_path / "r.html").exists()


def test_the_parent_never_imports_torch(tmp_path):
    code = ("import sys; from nanreplay.cli import main\n"
            f"try: main(['analyze', {str(SAMPLE)!r}, '--json', 'a.json', '-o', 'r.html', '--markdown', 'r.md'])\n"
            "except SystemExit as e: assert not e.code, e.code\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
    assert json.loads((tmp_path / "a.json").read_text())["verdict"] == "culprit_found"


def test_the_parent_reads_local_source_only_under_the_folders_named(tmp_path):
    """A child taken over by a kernel exploit writes any JSON it likes: the report (in the parent) then reads a
    local file for a source line only under --source, resolved (no symlink out)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.py").write_text("x = 1\n")
    (tmp_path / "src" / "out.py").symlink_to(tmp_path / "settings.py")
    sources = [{"file": "a.py", "line": 1, "path": str(p)} for p in
               (tmp_path / "src" / "model.py", tmp_path / "settings.py", tmp_path / "src" / "out.py", "rel/x.py")]
    d = {"culprit": {"source": sources[0]}, "chain": [{"source": s} for s in sources[1:]]}
    confine._local_paths_only_under(d, [str(tmp_path / "src")])
    assert d["culprit"]["source"]["path"] == str(tmp_path / "src" / "model.py")
    assert [e["source"]["path"] for e in d["chain"]] == [None, None, None]
    confine._local_paths_only_under(d, [])
    assert d["culprit"]["source"]["path"] is None
