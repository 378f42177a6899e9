"""The code shown is the code tested.

* The culprit call is found the way it ran: operator, method or function; its literal arguments; its
  place among the calls of that name on the line.
* A rewritten line is replayed at every call that expression makes (each block of a stack), and a changed
  operand is executed exactly as shown.
* Where no line is rewritten, the fix is guidance (a comment) and says it was tested as an op-level patch;
  no fix uses a name the user's code does not have.
* Source comes through one door, `codefix.source_lines`, and a window of recorded lines is enough.
"""

from __future__ import annotations

import ast

import pytest
import torch

import causes
import nanmodels
from nanreplay import formats, verify
from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.fixes import fmt

pytestmark = pytest.mark.filterwarnings(r"ignore:std\(\):UserWarning")

FIXTURES = [pytest.param(m, n, id=f"{m.__name__}.{n}") for m in (causes, nanmodels) for n in m.CASES
            if m.CASES[n].expect.get("verdict", "culprit_found") == "culprit_found"]
KNOWN = {"torch", "F", "math", "max", "min", "float", "int"}


def _names(code: str) -> set[str]:
    try:
        tree = ast.parse(code)
    except SyntaxError:  # a block header such as `with torch.autocast(...):`
        tree = ast.parse(code + "\n    pass")
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


@pytest.mark.parametrize("module,name", FIXTURES)
def test_a_fix_uses_only_the_users_names_or_is_guidance(run_case, module, name):
    d = run_case(name, module=module)[0].to_json()
    for fix in [d["diagnosis"]["fix"], *d["diagnosis"]["candidates"]]:
        if fix["after"] and len(fix["edits"]) > 1:  # several lines: each shown, new names only those it assigns
            befores = set().union(*(_names(e["before"]) for e in fix["edits"]))
            made = {n.id for e in fix["edits"] for s in ast.parse(e["after"]).body if isinstance(s, ast.Assign)
                    for n in s.targets if isinstance(n, ast.Name)}
            for e in fix["edits"]:
                assert e["after"] in fix["code"] and _names(e["after"]) <= befores | made | KNOWN, e
        elif fix["after"]:
            assert fix["code"] == fix["after"]
            assert _names(fix["after"]) <= _names(fix["before"]) | KNOWN, (fix["before"], fix["after"])
        elif fix["tested_as"] == "step":  # a whole-step change (the autocast dtype): code with torch's names only
            assert _names(fix["code"]) <= KNOWN, fix["code"]
        else:  # nothing of the user's rewritten: words, as comments, never code with made-up names
            assert all(ln.startswith("#") for ln in fix["code"].splitlines()), fix["code"]
        if fix["tested_as"] == "op":
            assert fix["after"] is None and "op-level patch" in (fix["verification"] or "")


def test_the_culprit_call_is_the_one_that_ran(run_case):
    """`h.pow(2).mean(-1) ** 0.5`: both powers reach torch as Tensor.pow; the culprit is the second on the line
    (and the one with exponent 0.5). The fix changes the `** 0.5`, and that is what was replayed."""
    res, path = run_case("pow_after_pow")
    fix = res.diagnosis["fix"]
    assert fix["before"].startswith("return (h.pow(2).mean(-1) ** 0.5).mean()")
    assert fix["after"].startswith(f"return ((h.pow(2).mean(-1) + {fmt(fix['epsilon'])}) ** 0.5).mean()")
    assert "h.pow(2)" in fix["after"]  # the first power is untouched
    call = res.step.call_of(res.step.events[res.culprit["event"]])
    assert fix["patched_calls"] == [call] and fix["tested_as"] == "line"
    assert res.step.call_names[call] == "Tensor.pow"
    first = next(i for i, n in enumerate(res.step.call_names) if n == "Tensor.pow")
    assert first < call  # h.pow(2) ran first, and was not patched


def test_a_line_fix_is_replayed_at_every_call_of_the_line(run_case):
    """The same `x / x.norm(...)` line runs in each of three blocks. The zero row passes block 0 unchanged
    (0/eps = 0) and breaks block 1 next: a patch at the culprit's call alone does not verify; the line's
    fix, replayed at all three calls, does."""
    res, path = run_case("every_block")
    fix = res.diagnosis["fix"]
    assert fix["verified"] is True and fix["tested_as"] == "line" and len(fix["patched_calls"]) == 3
    c = causes.CASES["every_block"]
    subject = formats.rebuild(formats.load(path), model=c.model_spec, loss=None, device=None, trust=False)
    call = res.step.call_of(res.step.events[res.culprit["event"]])
    assert call == fix["patched_calls"][0]
    alone = verify.try_patch(subject, {call: lambda f, a, k: f(a[0], a[1].clamp_min(1e-8), **k)})
    assert alone.ok is False and "blocks.1" in alone.detail


def test_a_boolean_mask_torch_turns_into_minus_inf_is_fixed_on_the_users_call(run_case):
    """nn.MultiheadAttention makes the -inf inside torch, from the boolean key_padding_mask the user's call passes:
    the edit is that call, passing the mask as the float mask torch would make, with finfo.min for -inf. It is
    replayed by the op-level patch at torch's masked_fill, the same arithmetic (never `scores = scores...`)."""
    d = run_case("mha_all_padding")[0].to_json()
    fix = d["diagnosis"]["fix"]
    assert fix["verified"] is True and "scores" not in fix["code"]
    assert fix["after"] == ("h, _ = self.mha(x, x, x, key_padding_mask=torch.zeros_like(pad, dtype=x.dtype)"
                            ".masked_fill(pad, torch.finfo(x.dtype).min))  # CULPRIT: mha_all_padding"), fix
    assert fix["before"] == "h, _ = self.mha(x, x, x, key_padding_mask=pad)  # CULPRIT: mha_all_padding"


def test_the_changed_operand_is_executed_as_shown():
    change = codefix.with_operand("other", lambda t: f"{codefix.paren(t)}.clamp_min(1e-7)")
    fn = codefix.compile_operand(change.operand)
    assert change.operand == "__x.clamp_min(1e-7)"
    assert torch.equal(fn(torch.tensor([0.0, 2.0])), torch.tensor([1e-7, 2.0]))
    # only nanreplay's own templates run: other names, dunder attributes are refused
    assert codefix.compile_operand("__import__('os')") is None
    assert codefix.compile_operand("__x.__class__") is None and codefix.compile_operand("os.system") is None


# ---------------------------------------------------------------- one door for source, and a window is enough


SOURCE = """\
class Model(nn.Module):
    def forward(self, a, b):
        d = torch.cat([a,
                       b], dim=-1)
        y = ((a - b) ** 2).sum(-1).sqrt() / torch.div(d.sum(-1), a.norm(dim=-1))
        return F.relu(y).mean()
"""


def _context(start: int, stop: int, line: int, code: str) -> dict:
    lines = SOURCE.splitlines()
    return {"file": "model.py", "line": line, "code": code, "path": "/nowhere/model.py",
            "context": {"start": start, "lines": lines[start - 1:stop]}}


def test_source_lines_prefers_the_recorded_context(tmp_path):
    f = tmp_path / "model.py"
    f.write_text("print('the local file')\n")
    src = {"file": "model.py", "line": 1, "code": "x", "path": str(f), "context": {"start": 7, "lines": ["a", "b"]}}
    assert codefix.source_lines(src) == (7, ["a", "b"])
    src.pop("context")
    assert codefix.source_lines(src) == (1, ["print('the local file')"])
    assert codefix.source_lines({"path": "/nowhere.py", "context": {"start": "1", "lines": ["x"]}}) is None


@pytest.mark.parametrize("start,stop", [(5, 5), (4, 6), (1, 6), (3, 5)])
def test_a_rewrite_needs_only_a_window_of_lines(start, stop):
    """The line alone, a window starting mid-statement, the whole class: the same rewrite, no file read."""
    src = _context(start, stop, 5, "y = ...")
    rw = codefix.rewrite(src, 5, "Tensor.sqrt", codefix.with_operand("input", lambda t: codefix.plus(t, "1e-9")))
    assert rw.before == "y = ((a - b) ** 2).sum(-1).sqrt() / torch.div(d.sum(-1), a.norm(dim=-1))"
    assert rw.after == "y = (((a - b) ** 2).sum(-1) + 1e-9).sqrt() / torch.div(d.sum(-1), a.norm(dim=-1))"


def test_operator_method_and_function_calls_are_told_apart():
    src = _context(5, 5, 5, "y = ...")
    change = codefix.with_operand("other", lambda t: f"{codefix.paren(t)}.clamp_min(1e-7)")
    # `/` reaches torch as Tensor.div: the operator, not torch.div(...) on the same line
    assert codefix.rewrite(src, 5, "Tensor.div", change).after == \
        "y = ((a - b) ** 2).sum(-1).sqrt() / torch.div(d.sum(-1), a.norm(dim=-1)).clamp_min(1e-7)"
    assert codefix.rewrite(src, 5, "torch.div", change).after.endswith(
        "torch.div(d.sum(-1), a.norm(dim=-1).clamp_min(1e-7))")
    # two .sum calls on the line: the second one that ran is `d.sum(-1)`
    first = codefix.locate(src, 5, "Tensor.sum", ordinal=(0, 2)).node
    second = codefix.locate(src, 5, "Tensor.sum", ordinal=(1, 2)).node
    assert ast.unparse(first.func.value) == "(a - b) ** 2" and ast.unparse(second.func.value) == "d"
    assert codefix.count_calls(src, 5, "Tensor.sum") == 2


def test_literal_arguments_and_the_functional_alias_from_a_window():
    src = _context(3, 6, 6, "return F.relu(y).mean()")
    assert codefix.literal_argument(_context(3, 6, 3, "d = ..."), "torch.cat", "dim", 0) == -1
    assert codefix.functional(src) == "F"
    assert codefix.functional(_context(5, 5, 5, "y = ...")) == "torch.nn.functional"
