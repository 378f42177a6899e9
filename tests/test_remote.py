"""Snapshots in object storage, against a real S3-compatible server (moto's server mode) on 127.0.0.1.

NanGuard(folder="s3://...") uploads its snapshot whole; `nanreplay analyze s3://...` downloads a bounded private copy
and says exactly what it says of the local file; an upload that fails is one warning, never an exception.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import nanmodels
from nanreplay import NanGuard
from nanreplay.cli import main

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_snapshots" / "zero_norm.pt"
WHY = "needs moto's server and s3fs: pip install 'moto[server]' s3fs (the test extra)"


@pytest.fixture(scope="module")
def s3():
    """A bucket on a moto S3 server of this test's own, and an s3fs client for it."""
    server_mod = pytest.importorskip("moto.server", reason=WHY)
    s3fs = pytest.importorskip("s3fs", reason=WHY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem()
        fs.mkdir("nan-bucket")
        yield fs
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def _bad_step(guard, model) -> bool:
    x = torch.randn(3, 4)
    guard.begin(x)
    return guard.loss_ok(model(x).sum() * float("nan"))


def test_guard_uploads_its_snapshot_whole(s3):
    model = nanmodels.tiny()
    guard = NanGuard(model, folder="s3://nan-bucket/run-17/nan", export=False)
    assert _bad_step(guard, model) is False
    url = guard.last_snapshot
    assert url and url.startswith("s3://nan-bucket/run-17/nan/nan_step") and url.endswith(".pt")
    s3.invalidate_cache()
    assert s3.ls("nan-bucket/run-17/nan") == [url.removeprefix("s3://")]  # the snapshot, nothing else
    data = s3.cat(url)
    assert data[:4] == b"PK\x03\x04"
    local = guard.folder / url.rsplit("/", 1)[1]
    assert not local.exists()  # uploaded: the staging copy is gone
    import io

    snap = torch.load(io.BytesIO(data), weights_only=True)
    assert snap["trigger"] == "loss"


def test_an_upload_that_fails_is_one_warning(s3):
    model = nanmodels.tiny()
    guard = NanGuard(model, folder="s3://no-such-bucket/nan", export=False)
    with pytest.warns(RuntimeWarning, match="could not upload the snapshot"):
        assert _bad_step(guard, model) is False  # training goes on
    assert guard.last_snapshot and Path(guard.last_snapshot).is_file()  # kept locally, and named
    s3.invalidate_cache()
    assert not s3.exists("no-such-bucket")


def test_analyze_reads_s3_as_the_local_file(s3, tmp_path, monkeypatch):
    s3.put_file(str(SAMPLE), "nan-bucket/samples/zero_norm.pt")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["analyze", "s3://nan-bucket/samples/zero_norm.pt", "--json", "remote.json",
                                    "--no-verify"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "zero_norm.nanreplay.html").is_file()  # named after the object, as for a local file
    res = CliRunner().invoke(main, ["analyze", str(SAMPLE), "--json", "local.json", "-o", "local.html",
                                    "--no-verify"])
    assert res.exit_code == 0, res.output
    remote, local = (json.loads((tmp_path / f).read_text()) for f in ("remote.json", "local.json"))
    assert remote["culprit"] == local["culprit"] and remote["diagnosis"]["cause"] == local["diagnosis"]["cause"]

    # bounded before download: an object over --max-memory is refused, nothing fetched
    res = CliRunner().invoke(main, ["analyze", "s3://nan-bucket/samples/zero_norm.pt", "--max-memory", "1K"])
    assert res.exit_code == 2 and "over the memory limit" in res.output and "nothing was downloaded" in res.output
    res = CliRunner().invoke(main, ["analyze", "s3://nan-bucket/samples/missing.pt"])
    assert res.exit_code == 2 and "no such object" in res.output and "Traceback" not in res.output


def test_no_client_is_imported_unless_a_url_is_used(tmp_path):
    code = ("import sys, torch; from nanreplay import NanGuard; import nanreplay.cli; import nanmodels\n"
            f"g = NanGuard(nanmodels.tiny(), folder={str(tmp_path)!r}, export=False)\n"
            "print(','.join(m for m in ('fsspec', 's3fs', 'gcsfs', 'botocore', 'aiobotocore') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""


def test_file_urls_need_no_extra_and_a_missing_client_is_one_line(tmp_path):
    """file:// goes through the same download (fsspec comes with torch); no S3 server needed. A file URI
    percent-encodes its path: a folder with a space in its name is `a%20b` in the URI."""
    spaced = tmp_path / "a b"
    spaced.mkdir()
    (spaced / SAMPLE.name).write_bytes(SAMPLE.read_bytes())
    res = CliRunner().invoke(main, ["analyze", (spaced / SAMPLE.name).as_uri(), "--json", str(tmp_path / "a.json"),
                                    "-o", str(tmp_path / "r.html"), "--no-verify"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "a.json").read_text())["diagnosis"]["cause"] == "normalize_zero_norm"
    res = CliRunner().invoke(main, ["analyze", "nosuchproto://bucket/x.pt", "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 2 and "no client for nosuchproto://" in res.output and "Traceback" not in res.output
    try:
        import gcsfs  # noqa: F401
    except ImportError:  # a known store whose optional client is not installed: the extra to install
        res = CliRunner().invoke(main, ["analyze", "gs://bucket/x.pt", "-o", str(tmp_path / "r.html")])
        assert res.exit_code == 2 and "pip install 'nanreplay[gcs]'" in res.output, res.output


def test_triage_of_a_bucket_in_parts_says_what_a_local_triage_says(s3, tmp_path):
    """s3:// prefix, two parts (each downloads only its own snapshots), merged == one local triage of the files."""
    import shutil

    local = tmp_path / "snaps"
    local.mkdir()
    for k in range(4):
        nanmodels.save_three_causes(k % 3, local / f"nan_snapshot_step_{10 + k}_rank{k % 2}.pt", k + 1)
    shutil.copy(local / "nan_snapshot_step_10_rank0.pt", local / "a_copy.pt")
    (local / "notes.txt").write_text("not a snapshot")
    for f in local.iterdir():
        s3.put_file(str(f), f"nan-bucket/fleet/{f.name}")
    opts = ["--model", "nanmodels:three_causes", "--no-verify", "--jobs", "1"]
    run = CliRunner().invoke
    assert run(main, ["triage", str(local), "-o", str(tmp_path / "one"), *opts]).exit_code == 0
    out = tmp_path / "split"
    for i in range(2):
        res = run(main, ["triage", "s3://nan-bucket/fleet", "-o", str(out), *opts, "--shard", f"{i}/2"])
        assert res.exit_code == 0, res.output
        part = json.loads((out / "parts" / f"part-{i}-of-2" / "part.json").read_text())
        mirrored = {p.name for p in (out / ".mirror").glob("*.pt")}
        assert {r["file"] for r in part["rows"]} <= mirrored  # the part's own snapshots were downloaded
    res = run(main, ["triage", "--merge", str(out)])
    assert res.exit_code == 0, res.output
    merged = json.loads((out / "groups.json").read_text())
    single = json.loads((tmp_path / "one" / "groups.json").read_text())
    def same(doc):  # the groups without where the reports are (the merged index links into the parts)
        return [({k: v for k, v in g.items() if k != "snapshots"},
                 [(s["file"], s["duplicate_of"], s["step"], s["rank"]) for s in g["snapshots"]]) for g in doc["groups"]]

    assert same(merged) == same(single) and len(same(single)) == 3
    assert merged["counts"]["snapshots"] == single["counts"]["snapshots"] == 5
    assert merged["failures"] == single["failures"] == [] and merged["ignored"] == []  # (notes.txt: not fetched)

    # again: nothing downloaded (the copies are current) and nothing analyzed (the cache)
    before = {p: p.stat().st_mtime_ns for p in (out / ".mirror").glob("*.pt")}
    res = run(main, ["triage", "s3://nan-bucket/fleet", "-o", str(out), *opts, "--shard", "0/2"])
    assert res.exit_code == 0 and "from cache" in res.output, res.output
    assert {p: p.stat().st_mtime_ns for p in (out / ".mirror").glob("*.pt")} == before

    # over the bound: listed by size and never fetched
    res = run(main, ["triage", "s3://nan-bucket/fleet", "-o", str(tmp_path / "small"), *opts, "--max-memory", "1K"])
    assert res.exit_code == 0 and res.output.count("(--max-memory); not downloaded") == 5, res.output
    assert not list((tmp_path / "small" / ".mirror").iterdir())
