"""The parent trusts nothing from its child: a fake child (tests/confine/liar.py) returns each hostile result, and
the parent answers with one line (or renders a safe report) — never a traceback, a hang, or a raw escape sequence."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from nanreplay import confine
from nanreplay.errors import NanReplayError, ReplayError, TimeLimitError, TrustError
from nanreplay.report import markdown_summary, render_html, terminal_lines

LIAR = str(Path(__file__).with_name("liar.py"))
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "sqrt_negative.json"
ESC, OSC52, BIDI = "\x1b", "\x1b]52;c;Y3VybCBldmlsIHwgc2g=\x07", "\u202e"
FORGED = "\nnanreplay: error: this snapshot is safe; re-run with --trust"
IMG = "<img src=x onerror=alert(1)>"


def _job(tmp_path: Path, lie: str, **kw) -> dict:
    snap = tmp_path / "snap.pt"
    snap.write_bytes(b"a snapshot")
    return {"path": str(snap), "shown": "snap.pt", "lie": lie, **kw}


def _lie(tmp_path: Path, payload: str | bytes, **kw):
    f = tmp_path / "payload"
    f.write_bytes(payload.encode() if isinstance(payload, str) else payload)
    return confine.run(_job(tmp_path, "payload", payload_file=str(f), **kw), entry=LIAR)


def _doc() -> dict:
    return json.loads(GOLDEN.read_text())


def _one_line_without_escapes(e: BaseException) -> str:
    text = str(e)
    assert ESC not in text and BIDI not in text and "\x07" not in text, text
    return text


def test_a_message_without_end_is_refused_at_its_bound_quickly(tmp_path, monkeypatch):
    monkeypatch.setattr(confine, "MAX_LINE", 8 << 20)
    t = time.monotonic()
    with pytest.raises(ReplayError, match="a message of more than 8 MiB"):
        confine.run(_job(tmp_path, "endless line", mib=64), entry=LIAR)
    assert time.monotonic() - t < 30


def test_a_grandchild_holding_the_pipe_does_not_hang_the_parent_and_is_killed(tmp_path):
    t = time.monotonic()
    d = confine.run(_job(tmp_path, "grandchild holds the pipe", doc=_doc()), entry=LIAR)
    assert d["verdict"] == "culprit_found"
    assert time.monotonic() - t < confine.EXIT_GRACE + 20
    # nothing of the child's group is left: no live process runs the liar with this job (SIGKILL is asynchronous)
    end = time.monotonic() + 10
    while (left := _alive_liars(str(tmp_path))) and time.monotonic() < end:
        time.sleep(0.1)
    assert not left


def _alive_liars(marker: str) -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if LIAR.encode() in cmd and marker.encode() in cmd and state != "Z":
            out.append(pid)
    return out


def test_a_child_that_says_nothing_is_stopped_at_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(confine, "DEADLINE_GRACE", 0.5)
    t = time.monotonic()
    with pytest.raises(TimeLimitError, match="no result within --timeout 1 s"):
        confine.run(_job(tmp_path, "silent", timeout=1), entry=LIAR)
    assert time.monotonic() - t < 20


@pytest.mark.parametrize(("name", "analysis", "words"), [
    ("required key of the wrong type", {**_doc(), "verdict": ["culprit_found"]}, "'verdict' is not a str"),
    ("a required key missing", {k: v for k, v in _doc().items() if k != "stats"}, "'stats' is not a dict"),
    ("nested past any analysis", {**_doc(), "warnings": json.loads("[" * 500 + "]" * 500)}, "nested deeper"),
    ("a huge string", {**_doc(), "verdict": "x" * (2 << 20)}, "a string of more than"),
])
def test_a_result_of_the_wrong_shape_is_one_line(tmp_path, name, analysis, words):
    with pytest.raises(ReplayError) as e:
        _lie(tmp_path, json.dumps({"analysis": analysis}) + "\n")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_bug_message_cannot_write_escapes_or_forge_a_line(tmp_path):
    with pytest.raises(RuntimeError) as e:
        _lie(tmp_path, json.dumps({"bug": f"Traceback{OSC52}\x1b[2J{BIDI}{FORGED}"}) + "\n")
    text = _one_line_without_escapes(e.value)
    assert not any(ln.startswith("nanreplay:") for ln in text.splitlines())


def test_an_error_message_cannot_write_escapes_or_forge_a_line(tmp_path):
    with pytest.raises(TrustError) as e:
        _lie(tmp_path, json.dumps({"error": {"type": "TrustError", "message": f"x{OSC52}{BIDI}{FORGED}"}}) + "\n")
    assert "\n" not in _one_line_without_escapes(e.value)
    with pytest.raises(ReplayError):  # a class that is not one of ours
        _lie(tmp_path, json.dumps({"error": {"type": "SystemExit", "message": "x"}}) + "\n")


def test_hostile_strings_in_a_well_formed_result_reach_no_renderer_raw(tmp_path):
    doc = _doc()
    doc["verdict"] = "no_culprit"  # the Markdown lists the non-finite leaves then
    doc["culprit"] = None
    doc["nonfinite_leaves"] = [{"name": f"x{OSC52}", "role": f"input{BIDI}", "nan": IMG, "inf": "[a](javascript:alert(1))"}]
    doc["diagnosis"]["explanation"] = f"{OSC52}{FORGED}{IMG}"
    d = _lie(tmp_path, json.dumps({"analysis": doc}) + "\n")
    md = markdown_summary(d)
    html = render_html(d)
    lines = "\n".join(terminal_lines(d, "r.html"))
    for out in (md, html, lines, json.dumps(d)):
        assert ESC not in out and "\\u001b" not in out and BIDI not in out and "\\u202e" not in out
    assert not re.search(r"(?<!\\)<img", md) and not re.search(r"(?<!\\)\]\(javascript:", md)  # escaped: shown as text
    assert IMG not in html


def test_only_our_error_classes_come_back(tmp_path):
    with pytest.raises(NanReplayError):
        _lie(tmp_path, b"\xff\xfe not json\n")


@pytest.mark.parametrize("op", ["aten.add.Tensor` kernel at node 3 (SIGSEGV); the snapshot is safe: re-run with --trust",
                                "aten.add.Tensor\nnanreplay: error: forged", "aten.add.Tensor" + ESC + "[2J"])
def test_a_crash_line_quotes_only_an_op_name_from_the_progress_page(tmp_path, op):
    """The progress page is the child's memory: a taken-over child writes what it likes there before it crashes.
    The crash line names the op only when the page holds an op name's form; otherwise it names the phase."""
    with pytest.raises(NanReplayError) as e:
        confine.run(_job(tmp_path, "forged crash", op=op), entry=LIAR)
    text = _one_line_without_escapes(e.value)
    assert "re-run" not in text and "forged" not in text and "aten.add" not in text, text
    assert "crashed torch (SIGSEGV in the replay; a crafted or corrupt snapshot)" in text, text


def test_a_crash_line_still_names_a_real_op(tmp_path):
    with pytest.raises(NanReplayError) as e:
        confine.run(_job(tmp_path, "forged crash", op="aten._weight_norm_interface.default"), entry=LIAR)
    assert "crashed torch's `aten._weight_norm_interface.default` kernel at node 3 (SIGSEGV in the replay" in str(e.value)
