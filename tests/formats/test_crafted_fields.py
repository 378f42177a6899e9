"""Crafted fields, strings and numbers, and what the outputs quote: each is one line (or a clean analysis),
never a traceback; the report quotes no local file the user did not name; pasted Markdown stays inert.

Found by the second round of crafted files (issue 25): float8 and meta-device tensors, lone surrogates,
recorded contexts that miss their line, integers of 400 digits where numbers are expected, a meta tensor as
a learning rate, a big-int pickle opcode, a frame naming ./mysite/settings.py, a code line holding a
Markdown fence, and `aten.empty`'s uninitialised memory.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from pathlib import Path

import pytest
import torch
from clirun import one_line_error, run
from crafting import R, save, valid_snapshot, with_nodes, with_program

from nanreplay import atomic

SECRET = "hunter2-do-not-leak"


@pytest.fixture
def valid(tmp_path) -> tuple[Path, dict]:
    return valid_snapshot(tmp_path)


def _adam(group: dict) -> dict:
    return {"class": "Adam", "state_dict": {"state": {}, "param_groups": [{"params": [0, 1], **group}]}}


def _frame0(edit):
    def fn(prog):
        edit(prog["frames"][0])
    return fn


FIELDS = {
    "a float8 buffer": (lambda d: d["state"].__setitem__("fc.f8", torch.zeros(3, dtype=torch.float8_e4m3fn)),
                        "float8_e4m3fn"),
    "a meta-device buffer": (lambda d: d["state"].__setitem__("fc.m", torch.empty(3, device="meta")), "meta tensor"),
    "a quantized-like dtype": (lambda d: d["state"].__setitem__("fc.u16", torch.zeros(3, dtype=torch.uint16)),
                               "uint16"),
    "a loss value of 400 digits": (lambda d: d.__setitem__("loss_value", 10**400), "digits"),
    "Adam eps of 400 digits": (lambda d: d.__setitem__("optimizer", _adam({"lr": 1e-3, "eps": 10**400})), "digits"),
    "a meta tensor as the learning rate": (
        lambda d: d.__setitem__("optimizer", _adam({"lr": torch.tensor(1e-3, device="meta")})), "meta tensor"),
    "a lone surrogate in a note": (lambda d: d.__setitem__("notes", ["fine \ud800"]), "lone surrogate"),
    "a lone surrogate in the recorded code": (
        lambda d: with_program(d, _frame0(lambda f: f.__setitem__("code", "x = 1  # \udcff"))), "lone surrogate"),
    "a lone surrogate in a module name": (
        lambda d: with_program(d, lambda p: p["modules"].__setitem__(0, "\ud83d")), "lone surrogate"),
    "a context that does not hold its line": (
        lambda d: with_program(d, _frame0(lambda f: f.__setitem__("context", [f["line"] + 50, ["x = 1"]]))),
        "does not hold the frame's line"),
    "a re-run loss that is a string": (lambda d: d["rerun"]["rerun"].__setitem__("loss", "1.5"),
                                        "rerun.rerun.loss must be a number"),
    "a non-finite count that is negative": (lambda d: d["rerun"]["training"].__setitem__("grads_nonfinite", -1),
                                            "out of range"),
    "a random op that is not a record": (lambda d: d["rerun"].__setitem__("random_ops", ["dropout"]),
                                         "rerun.random_ops[0] must be a dict"),
    "a host that is a list": (lambda d: d["machine"].__setitem__("host", ["host-17"]), "machine.host must be a string"),
    "an entry frame whose context misses its line": (
        lambda d: d.__setitem__("entry", {"file": "loop.py", "line": 9, "function": "train", "code": "guard.begin(x)",
                                          "context": [40, ["guard.begin(x)"]]}), "does not hold the frame's line"),
    "a construction whose call lies outside its statement": (
        lambda d: d.__setitem__("constructions", [{"module": "", "file": "m.py", "line": 3, "function": "", "code": "m = 1",
                                                   "context": [3, ["m = 1"]], "call": [7, 0]}]),
        "not in its statement's lines"),
    "a float literal beyond float range": (
        lambda d: d.__setitem__("step_program", d["step_program"].replace('"schema"', '"x": 1e400, "schema"', 1)),
        "out of range"),
}


@pytest.mark.parametrize("name", FIELDS)
def test_a_crafted_field_is_one_line(valid, tmp_path, name):
    _, d = valid
    edit, words = FIELDS[name]
    edit(d)
    p = save(d, tmp_path / "crafted.pt")
    res = run("analyze", p, "-o", tmp_path / "r.html", "--json", tmp_path / "r.json", "--markdown",
              tmp_path / "r.md")
    one_line_error(res, 2, words)
    assert not any((tmp_path / n).exists() for n in ("r.html", "r.json", "r.md"))


def test_a_big_int_pickle_is_corrupt_not_a_trust_question(tmp_path):
    """A file whose only oddity is a big-int opcode (LONG4) holds no object: --trust would change nothing."""
    buf = io.BytesIO()
    torch.save({"format": "nanreplay.snapshot", "version": 2}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    p = tmp_path / "bigint.pt"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as z:
        for n in src.namelist():
            data = src.read(n)
            if n.endswith("data.pkl"):
                data = pickle.dumps({"format": "nanreplay.snapshot", "version": 2, "x": 2**3000}, protocol=2)
            z.writestr(n, data)
    err = one_line_error(run("analyze", p, "-o", tmp_path / "r.html"), 2, "corrupt or unsupported")
    assert "--trust" not in err


def test_the_atomic_writer_writes_a_lone_surrogate_as_a_question_mark(tmp_path):
    """A path of undecodable bytes reaches the outputs as Python spells it (a lone surrogate): never a traceback."""
    atomic.write_text(tmp_path / "r.html", "file \udcff.py")
    assert (tmp_path / "r.html").read_text(encoding="utf-8") == "file ?.py"


# ---------------------------------------------------------------- local files


SETTINGS = f"import os\nDEBUG = False\nDB_PASSWORD = '{SECRET}'\nAPI_KEY = '{SECRET}'\n"


def _frame_names(d: dict, file: str, line: int, code: str) -> dict:
    """Every node's frame: `file` at `line`, recorded code `code`, no recorded context."""
    def edit(prog):
        prog["frames"] = [{"file": file, "line": line, "function": "forward", "code": code}]
        for n in prog["nodes"]:
            n["frame"] = 0
    return with_program(d, edit)


def _everything(res, folder: Path) -> str:
    return res.output + "".join(p.read_text(encoding="utf-8", errors="replace") for p in folder.glob("r.*"))


def test_a_guessable_line_does_not_open_a_local_file(valid, tmp_path):
    """The frame names …/mysite/settings.py line 2, `DEBUG = False`, with no context: the analyst's own
    ./mysite/settings.py has that line, and is still not read (no --source)."""
    _, d = valid
    work = tmp_path / "work"
    (work / "mysite").mkdir(parents=True)
    (work / "mysite" / "settings.py").write_text(SETTINGS)
    p = save(_frame_names(d, "/srv/app/mysite/settings.py", 2, "DEBUG = False"), tmp_path / "frames.pt")
    res = run("analyze", p, "-o", work / "r.html", "--json", work / "r.json", "--markdown", work / "r.md", cwd=work)
    assert res.exit_code == 0, res.output
    assert SECRET not in _everything(res, work) and "DB_PASSWORD" not in _everything(res, work)
    src = json.loads((work / "r.json").read_text())["culprit"]["source"]
    assert src["path"] is None and src["context"] is None and src["file"] == "/srv/app/mysite/settings.py"


def test_a_named_source_folder_is_read_only_where_the_line_matches_and_never_through_a_link(valid, tmp_path):
    _, d = valid
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SETTINGS)
    src_dir = tmp_path / "src"
    (src_dir / "mysite").mkdir(parents=True)
    (src_dir / "mysite" / "settings.py").symlink_to(outside / "secret.txt")  # a .py name, a file out of the folder
    (src_dir / "mysite" / "urls.py").write_text(SETTINGS)  # inside, a real .py file
    (src_dir / "mysite" / "notes.txt").write_text(SETTINGS)
    for file, readable in (("/srv/mysite/settings.py", False), ("/srv/mysite/notes.txt", False),
                           ("/srv/mysite/urls.py", True)):
        out = tmp_path / f"out_{Path(file).stem}"
        out.mkdir()
        p = save(_frame_names(torch.load(valid[0], weights_only=True), file, 2, "DEBUG = False"), out / "f.pt")
        res = run("analyze", p, "-o", out / "r.html", "--json", out / "r.json", "--source", src_dir)
        assert res.exit_code == 0, res.output
        src = json.loads((out / "r.json").read_text())["culprit"]["source"]
        # the user named the folder and its line is the recorded one: their copy of the file is recognised, but
        # no line the snapshot did not record is shown from it (a guessable line must not quote its neighbours)
        assert src["path"] == (str(src_dir / "mysite" / "urls.py") if readable else None)
        assert SECRET not in _everything(res, out) and "DB_PASSWORD" not in _everything(res, out)


# ---------------------------------------------------------------- Markdown that people paste


def _outside_code(md: str) -> str:
    """The Markdown with its fenced blocks (fences matched as CommonMark does) and code spans taken out."""
    lines, out, i = md.splitlines(), [], 0
    while i < len(lines):
        m = re.match(r"^(`{3,})", lines[i])
        if m:
            fence = m.group(1)
            i += 1
            while i < len(lines) and not re.match(rf"^`{{{len(fence)},}}\s*$", lines[i]):
                i += 1
            i += 1
            continue
        out.append(lines[i])
        i += 1
    text = "\n".join(out)
    return re.sub(r"(`+)(.+?)\1", "", text)


def test_a_code_line_holding_a_fence_stays_inside_its_code_block(valid, tmp_path):
    _, d = valid
    code = "y = x  # ```\n<img src=x onerror=alert(1)>\n```"
    p = save(_frame_names(d, "/srv/model.py", 7, code), tmp_path / "f.pt")
    res = run("analyze", p, "-o", tmp_path / "r.html", "--markdown", tmp_path / "r.md")
    assert res.exit_code == 0, res.output
    md = (tmp_path / "r.md").read_text()
    assert "onerror" in md  # quoted, as code
    assert "<img" not in _outside_code(md) and "onerror" not in _outside_code(md), md


# ---------------------------------------------------------------- uninitialised memory


def test_empty_replays_as_zeros_that_no_mode_sees_uninitialised(valid, tmp_path):
    """`aten.empty`'s output is zeroed before the replay's instrumentation sees it: NaN left in the freed
    memory it reuses never reaches an event or the statistics."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nanreplay import formats

    _, d = valid
    n = 1 << 12  # small enough for the heap to hand the NaN-filled block back
    nodes = [("aten.full.default", [[n], {"f": "nan"}], {}, [[[n], "float32"]]),
             ("aten.empty.memory_format", [[n]], {}, [[[n], "float32"]]),
             ("aten.add.Tensor", [R(1), 1.0], {}, [[[n], "float32"]])]
    p = save(with_nodes(d, {}, nodes), tmp_path / "e.pt")
    subject = formats.rebuild(formats.load(p), model=None, loss=None, device=None, trust=False)
    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func).startswith("aten.add.Tensor") and isinstance(out, torch.Tensor) and out.numel() == n:
                seen.append(out.clone())
            if str(func).startswith("aten.empty"):
                seen.append("empty seen")
            return out

    for _ in range(3):
        with Watch():
            subject.model(subject.inputs, subject.target)
    assert "empty seen" not in seen
    assert seen and all(bool((s == 1).all()) for s in seen)


def test_a_report_of_a_context_that_misses_its_line_shows_the_line_alone(valid):
    """The schema refuses such a snapshot; an analysis JSON that says so anyway still renders (no KeyError)."""
    from nanreplay import report
    from nanreplay.analysis import analyze

    d = analyze(valid[0], verify=False).to_json()
    d["culprit"]["source"]["context"] = {"start": d["culprit"]["source"]["line"] + 40, "lines": ["x = 1", "y = 2"]}
    page = report.render_html(d)
    assert "x = 1" not in page and d["culprit"]["source"]["code"].split("(")[0] in page
