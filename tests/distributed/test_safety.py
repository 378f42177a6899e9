"""A sharded snapshot folder from a stranger: nothing in it runs code, names a file outside it, or makes the
analysis allocate what it does not hold. DCP's own `.metadata` (a pickle) is never read."""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from nanreplay import formats
from nanreplay.analysis import analyze
from nanreplay.cli import main
from nanreplay.errors import LimitError, SnapshotError, UsageError


class Planted:
    """Unpickling this runs a shell command that leaves a file behind."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def contents(p: Path) -> dict:
    return json.loads((p / "nanreplay.json").read_text())


def rewrite(p: Path, d: dict) -> None:
    (p / "nanreplay.json").write_text(json.dumps(d))


def test_dcp_metadata_pickle_is_never_read(folder, tmp_path):
    p = folder("a")
    marker = tmp_path / "ran"
    (p / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    a = analyze(p, verify=False).to_json()
    assert a["culprit"]["rank"] == 1 and not marker.exists()


def test_a_chunk_holding_a_pickled_object_is_refused(folder, tmp_path):
    p = folder("a")
    marker = tmp_path / "ran"
    torch.save({"x": Planted(marker)}, p / "planted.distcp")
    d = contents(p)
    ch = d["tensors"]["model/inp.weight"]["chunks"][0]
    ch.update(file="planted.distcp", offset=0, length=(p / "planted.distcp").stat().st_size)
    rewrite(p, d)
    with pytest.raises(SnapshotError, match="pickled Python objects .it references posix.system"):
        analyze(p, verify=False)
    assert not marker.exists()


@pytest.mark.parametrize("name, words", [("../outside.distcp", "not a plain file name"),
                                         ("/etc/passwd", "not a plain file name"),
                                         (".metadata", "not a plain file name"),
                                         ("missing.distcp", "cannot read")])
def test_chunk_files_are_plain_files_of_the_folder(folder, name, words):
    p = folder("b")
    d = contents(p)
    d["tensors"]["model/head.weight"]["chunks"][0]["file"] = name
    rewrite(p, d)
    with pytest.raises(SnapshotError, match=words):
        analyze(p, verify=False)


def test_links_and_ranges_outside_the_file_are_refused(folder, tmp_path):
    p = folder("b")
    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes((p / "__0_0.distcp").read_bytes())
    (p / "__0_0.distcp").unlink()
    (p / "__0_0.distcp").symlink_to(outside)
    with pytest.raises(SnapshotError, match="not a regular file"):
        analyze(p, verify=False)
    q = folder("c")
    d = contents(q)
    d["tensors"]["model/head.weight"]["chunks"][0]["offset"] = 10**9
    rewrite(q, d)
    with pytest.raises(SnapshotError, match="claims bytes"):
        analyze(q, verify=False)


def test_chunks_must_tile_each_tensor(folder):
    p = folder("a")
    d = contents(p)
    d["tensors"]["model/blocks.0.fc1.weight"]["chunks"].pop()
    rewrite(p, d)
    with pytest.raises(SnapshotError, match="do not cover"):
        formats.load(p)
    d["tensors"]["model/blocks.0.fc1.weight"]["chunks"] = [{"offsets": [0, 0], "sizes": [12, 8]},
                                                            {"offsets": [4, 0], "sizes": [4, 8]}]
    rewrite(p, d)
    with pytest.raises(SnapshotError, match="overlap"):
        formats.load(p)
    d["tensors"]["model/blocks.0.fc1.weight"]["chunks"] = [{"offsets": [0, 0], "sizes": [32, 8]}]
    rewrite(p, d)
    with pytest.raises(SnapshotError, match="outside its shape"):
        formats.load(p)


def test_a_zip_bomb_chunk_is_refused(folder):
    p = folder("a")
    bomb = p / "bomb.distcp"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data/0", b"\0" * (64 << 20))
    d = contents(p)
    d["tensors"]["model/inp.weight"]["chunks"][0].update(file="bomb.distcp", offset=0, length=bomb.stat().st_size)
    rewrite(p, d)
    with pytest.raises(SnapshotError, match="zip bomb"):
        analyze(p, verify=False)


@pytest.mark.parametrize("text, words", [
    ('{"format": "nanreplay.sharded", "version": 1, "step": NaN}', "not valid JSON"),
    ('{"format": "nanreplay.sharded", "format": "x"}', "duplicate key"),
    ('[1, 2]', "expected an object"),
])
def test_the_table_of_contents_is_strict_json(folder, text, words):
    p = folder("d")
    (p / "nanreplay.json").write_text(text)
    with pytest.raises(SnapshotError, match=words):
        formats.load(p)


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(version=99), "newer than this nanreplay"),
    (lambda d: d.update(world_size="2"), "world_size must be an integer"),
    (lambda d: d.update(grad_norm=10**400), "digits, not a number"),  # an OverflowError once
    (lambda d: d.update(nonfinite_ranks=[5]), "non-finite rank 5 of a world of 2"),
    (lambda d: d["tensors"]["model/inp.weight"]["chunks"][0].update(transforms=["zstd"]), "transforms"),
    (lambda d: d["tensors"]["model/inp.weight"].update(dtype="object"), "dtype must be one of"),
    (lambda d: d["parameters"].append("ghost.weight"), "parameter 'ghost.weight' is not in the checkpoint"),
])
def test_every_field_is_checked(folder, change, words):
    p = folder("d")
    d = contents(p)
    change(d)
    rewrite(p, d)
    with pytest.raises(SnapshotError, match=words):
        formats.load(p)


def test_rank_parts_are_checked(folder):
    p = folder("a")
    (p / "rank1.json").unlink()
    with pytest.raises(SnapshotError, match="rank1.json: missing"):
        formats.load(p)
    q = folder("b")
    part = json.loads((q / "rank0.json").read_text())
    part["batch"]["inputs"] = {"tensor": "rank1/batch/0"}  # another rank's tensor
    (q / "rank0.json").write_text(json.dumps(part))
    with pytest.raises(SnapshotError, match="this rank did not store"):
        formats.load(q)


def test_a_program_with_a_forbidden_op_is_refused_for_its_rank(folder):
    p = folder("a")
    prog = json.loads((p / "rank0.program.json").read_text())
    prog["nodes"][0]["op"] = "aten.from_file.default"
    (p / "rank0.program.json").write_text(json.dumps(prog))
    a = analyze(p, verify=False).to_json()
    assert a["culprit"]["rank"] == 1  # rank 1's own program still replays
    assert any("rank 0 was not replayed" in w and "from_file" in w for w in a["warnings"])
    (p / "rank1.program.json").write_text(json.dumps(prog))
    with pytest.raises(SnapshotError, match="no rank's step can be replayed"):
        analyze(p, verify=False)


def test_a_plain_value_overload_in_a_rank_program_is_refused(folder):
    """`remainder.int(5, 0)` would run for real in the dry run (SIGFPE): it is not on the allowlist, for any rank."""
    p = folder("a")
    for r in (0, 1):
        prog = json.loads((p / f"rank{r}.program.json").read_text())
        prog["nodes"].insert(0, {"op": "aten.remainder.int", "args": [5, 0], "out": 10**6, "meta": []})
        (p / f"rank{r}.program.json").write_text(json.dumps(prog))
    with pytest.raises(SnapshotError, match="no rank's step can be replayed"):
        analyze(p, verify=False)


def test_limits_and_usage(folder, tmp_path):
    p = folder("c")
    with pytest.raises(LimitError, match="a quarter of --max-memory"):
        analyze(p, max_memory=4096)  # nanreplay.json itself, before it is parsed
    enough_for_the_json = 4 * (p / "nanreplay.json").stat().st_size + 64
    with pytest.raises(LimitError, match="more than --max-memory"):
        analyze(p, max_memory=enough_for_the_json)  # the tensors (more than that), before one is allocated
    with pytest.raises(UsageError, match="--model and --loss do not apply"):
        analyze(p, model="nanmodels:factory")
    with pytest.raises(UsageError, match="--nproc 2"):
        analyze(p, nproc=3)  # refused before any rank starts
    single = tmp_path / "one.pt"
    torch.save({"x": torch.ones(2)}, single)
    with pytest.raises(UsageError, match="single file"):
        analyze(single, nproc=2)
    empty = tmp_path / "empty_folder"
    empty.mkdir()
    with pytest.raises(SnapshotError, match="without nanreplay.json"):
        formats.load(empty)
    (empty / "nanreplay.json").symlink_to(p / "nanreplay.json")
    with pytest.raises(SnapshotError, match="not a regular file"):
        formats.load(empty)


def test_the_command_line_says_one_line(folder):
    p = folder("b")
    d = contents(p)
    d["tensors"]["model/head.weight"]["chunks"][0]["file"] = "../../etc/passwd"
    rewrite(p, d)
    res = CliRunner().invoke(main, ["analyze", str(p), "-o", "-"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "not a plain file name" in res.output and len(res.output.strip().splitlines()) == 1
