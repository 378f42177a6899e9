"""The compiler's differential replay (nanreplay/differential/compiler.py) on a compiled step whose compiled
numerics differ from eager (tests/compiledstep.py).

The fast tests compile with `sequential_sums`, a registered torch.compile backend that keeps the captured graph
but adds every sum left to right: the same overflow inductor makes on this kind of CPU (the test at the end runs
real inductor, confined), independent of the CPU's vector width and without a C++ compile per replay. It tests the
bisection honestly: the pass does not know which op the backend changes.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import compiledstep
import pytest
import torch

from nanreplay import confine, formats
from nanreplay.analysis import analyze
from nanreplay.confine import filters
from nanreplay.confine.child import COMPILE_FSIZE
from nanreplay.differential import compiler
from nanreplay.report import markdown_summary, render_html, terminal_summary

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> str:
    path = compiledstep.train_snapshot(tmp_path_factory.mktemp("compiled"), backend=compiledstep.sequential_sums)
    assert path is not None, "the compiled run stayed finite: no snapshot to analyze"
    return path


@pytest.fixture(scope="module")
def confirmed(snapshot) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiler, "BACKEND", compiledstep.sequential_sums)
        return analyze(snapshot).to_json()


def test_the_eager_replay_is_finite_and_the_compiled_one_is_not(confirmed):
    assert confirmed["verdict"] == "not_reproduced" and confirmed["snapshot_info"]["environment"]["compiled"]
    c = confirmed["differential"]["compiler"]
    assert c["verdict"] == "compiled_numerics_confirmed" and c["skipped"] is None
    eager, comp, ctrl = c["ran"][:3]
    assert (eager["what"], eager["finite"]) == ("eager", True)
    assert comp["what"] == "compiled (sequential_sums)" and not comp["loss_finite"] and comp["where"] == "the whole step"
    assert ctrl["what"] == "compiled (aot_eager)" and ctrl["finite"]
    # the control compiles the same graph without changing its numerics: eager's loss and gradient norm
    assert math.isclose(ctrl["loss"], eager["loss"], rel_tol=1e-4)
    assert math.isclose(ctrl["grad_norm"], eager["grad_norm"], rel_tol=1e-4)
    assert math.isclose(eager["loss"], confirmed["loss"], rel_tol=1e-4)  # this pass's eager is the analysis's replay


def test_the_bisection_names_the_smallest_region_and_its_ops(confirmed):
    c = confirmed["differential"]["compiler"]
    r = c["region"]
    assert r["module"] == "pool" and r["alone"] and r["ops"] == ["aten.sum.dim_IntList"]
    assert r["source"]["code"].startswith("return h.sum(-1, keepdim=True)")
    tried = {row["where"]: row["finite"] for row in c["ran"][3:] if row["what"] == "compiled (sequential_sums)"}
    # every module call before it was compiled alone and stayed finite; the region alone reproduces the failure
    assert tried["module 'enc' (nodes 0-1)"] and tried["module 'act' (nodes 2-5)"]
    assert tried[r["where"]] is False


def test_the_fix_candidates_are_replayed_and_the_diagnosis_comes_from_them(confirmed):
    c = confirmed["differential"]["compiler"]
    fixes = {f["kind"]: f for f in c["fixes"]}
    assert set(fixes) == {"compiler_disable", "wider_dtype", "backend"}
    assert all(f["verified"] for f in fixes.values())
    by_what = {row["what"]: row for row in c["ran"]}
    for f in fixes.values():  # each verification is one of the replays made
        assert by_what[f["replay"]]["finite"] and math.isclose(f["loss"], c["ran"][0]["loss"], rel_tol=1e-4)
    assert "torch.compiler.disable" in fixes["compiler_disable"]["code"] and "'pool'" in fixes["compiler_disable"]["code"]
    diag = confirmed["diagnosis"]
    assert diag["cause"] == "compiled_numerics" and "module 'pool'" in diag["title"]
    assert diag["explanation"] == c["sentence"] and "aten.sum.dim_IntList" in diag["explanation"]
    assert diag["fix"]["kind"] == "compiler" and diag["fix"]["verified"] is True
    assert diag["fix"]["code"] == fixes["compiler_disable"]["code"]
    assert len(diag["candidates"]) == 3


def test_the_report_shows_it_in_the_verdict_area(confirmed):
    html = render_html(confirmed)
    verdict = html[html.index('<section id="verdict"'):html.index("</section>", html.index('<section id="verdict"'))]
    assert 'data-compiler="compiled_numerics_confirmed"' in verdict and "module &#39;pool&#39; (node" in verdict
    assert '<section id="compiler" data-verdict="compiled_numerics_confirmed">' in html
    term = terminal_summary(confirmed, None)
    assert term.splitlines()[0].endswith(": reproduced compiled (finite in eager)")
    line = next(ln for ln in term.splitlines() if ln.strip().startswith("compiled "))
    assert "compiled numerics confirmed in module 'pool'" in line and "verified fix: torch.compiler.disable" in line
    assert "**Compiled replay:** compiled numerics confirmed in module 'pool'" in markdown_summary(confirmed)


def test_a_step_finite_compiled_too_is_not_reproduced_compiled(snapshot):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiler, "BACKEND", "aot_eager")  # compiled exactly as eager computes it
        d = analyze(snapshot, verify=False).to_json()
    c = d["differential"]["compiler"]
    assert c["verdict"] == "not_reproduced_compiled" and c["region"] is None and c["fixes"] == []
    assert [row["finite"] for row in c["ran"]] == [True, True, True]
    assert d["diagnosis"]["cause"] == "compiled_numerics" and c["sentence"] in d["diagnosis"]["explanation"]


@pytest.fixture(scope="module")
def subject(snapshot):
    return formats.rebuild(formats.load(snapshot), model=None, loss=None, device=None, trust=False)


def test_no_cxx_compiler_is_one_line(subject, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    c = compiler.run(subject, backend="inductor")
    assert c["verdict"] == "skipped" and c["ran"] == [] and c["skipped_for"] == "toolchain"
    assert c["skipped"].startswith("no C++ compiler here") and "\n" not in c["sentence"]


def test_a_confined_child_without_a_scratch_folder_asks_for_one(subject, monkeypatch):
    monkeypatch.setitem(compiler.SANDBOX, "confined", True)
    c = compiler.run(subject, backend="inductor")
    assert c["verdict"] == "skipped" and c["skipped_for"] == compiler.SANDBOX_NEEDED and c["ran"] == []


@pytest.mark.skipif(filters.landlock_abi() is None or shutil.which("cc") is None,
                    reason="no Landlock on this kernel, or no C compiler")
def test_the_compile_child_writes_and_compiles_only_in_its_own_scratch_folder(tmp_path):
    """The one widening (docs/trust.md): files in a private scratch folder, removed afterwards, and the C compiler
    run there; everything else stays denied (the analyst's files, a file elsewhere, sockets)."""
    snap = tmp_path / "in" / "snap.pt"
    snap.parent.mkdir()
    snap.write_bytes(b"a snapshot")
    secret = tmp_path / "settings.py"
    secret.write_text("API_KEY = 'x'\n")
    job = {"path": str(snap), "shown": "snap.pt", "probe": "compile", "max_memory": 1 << 30, "compile": True,
           "reads": {"snapshot": str(snap), "cwd_file": str(secret)}, "writable": str(tmp_path), "port": 9}
    d = confine.run(job, entry=str(ROOT / "tests" / "confine" / "probe.py"))
    got = d["attempts"]
    assert got["scratch"] == "compiled and ran: 42", got["scratch"]
    assert got["snapshot"] == "read" and got["cwd_file"].startswith("denied") and got["create"].startswith("denied")
    assert all(got[k].startswith("denied") for k in ("AF_INET", "AF_INET6", "AF_UNIX")), got
    env = d["environment"]
    scratch = env["env"]["TMPDIR"]
    assert env["env"]["TORCHINDUCTOR_CACHE_DIR"].startswith(scratch) and env["env"]["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert not Path(scratch).exists()  # removed afterwards
    c = env["confinement"]
    assert c["rlimits"]["fsize"] == COMPILE_FSIZE and c["writes"] == ["the compile child's own scratch folder", "/dev/null"]
    assert c["landlock"].startswith("abi ") and c["seccomp"] is True and c["lost"] is None


def test_it_does_not_run_on_a_plain_culprit(tmp_path):
    """A compiled run whose eager replay names a culprit: eager already answers (the user's code); no compile."""
    snap = torch.load(ROOT / "sample_snapshots" / "sqrt_zero.pt", weights_only=True)
    snap["environment"] = {**(snap.get("environment") or {}), "compiled": True}
    torch.save(snap, tmp_path / "compiled_sqrt.pt")
    d = analyze(tmp_path / "compiled_sqrt.pt", verify=False).to_json()
    # (the sample carries the guard's re-run: its machine question, never the compiler's)
    assert d["verdict"] == "culprit_found" and "compiler" not in (d.get("differential") or {})


def test_regions_compile_every_sample_program_as_eager_computes_it():
    """The family: every sample snapshot's step program (embeddings, softmax, norms, fp16 casts, dropout masks)
    compiled whole by aot_eager through regions.py gives eager's loss and the same non-finite gradients."""
    from nanreplay.differential import regions

    for name in ("fp16_overflow.pt", "zero_norm.pt"):
        sub = formats.rebuild(formats.load(ROOT / "sample_snapshots" / name), model=None, loss=None, device=None,
                              trust=False)
        n = len(sub.model.program.nodes)
        eager = regions.replay(sub, {})
        fn = torch.compile(regions.region_graph(sub.model, 0, n), backend="aot_eager", fullgraph=True, dynamic=False)
        comp = regions.replay(sub, {(0, n): fn})
        assert (comp["loss_finite"], comp["nonfinite_grads"]) == (eager["loss_finite"], eager["nonfinite_grads"]), name
        if eager["loss_finite"]:
            assert math.isclose(comp["loss"], eager["loss"], rel_tol=1e-4), name
    torch.compiler.reset()


@pytest.mark.skipif(not os.environ.get("NANREPLAY_INDUCTOR_TESTS"), reason="real inductor compiles take minutes on "
                    "a CPU: set NANREPLAY_INDUCTOR_TESTS=1 to run them")
def test_real_inductor_confined_end_to_end(tmp_path):
    """The run compiled with inductor overflows where eager does not (on CPUs whose inductor sums a row in 16
    lanes); `nanreplay analyze` (confined: the compile child) confirms it and names `pool`."""
    snap = compiledstep.train_snapshot(tmp_path / "run")
    if snap is None:
        pytest.skip("inductor's sum on this CPU cancels as eager's does: the compiled run stayed finite")
    d = confine.analyze(snap, max_memory=4 << 30)
    c = d["differential"]["compiler"]
    assert c["verdict"] == "compiled_numerics_confirmed" and c["region"]["module"] == "pool", c["sentence"]
    assert d["environment"]["confinement"]["rlimits"]["fsize"] == COMPILE_FSIZE
    assert d["diagnosis"]["fix"]["verified"] is True
