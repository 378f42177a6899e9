"""crossline.Definitions on recorded source lines: which assignment a culprit's line reads, and when it must stay."""

from __future__ import annotations

from nanreplay.diagnose.edits import crossline

CODE = """def loss_fn(out, y):
    pi, mu, sigma = out
    z = (y - mu) / sigma
    dens = pi * torch.exp(-0.5 * z ** 2) / sigma
    nll = -torch.log(dens.sum(-1))
    return nll.mean()


def other(out, y):
    dens = out.exp()
    if y is not None:
        dens = dens * 2
    total = torch.log(dens.sum(-1))
    return total + dens.mean()
"""


def _source(first: int, last: int) -> dict:
    """A culprit source dict as a snapshot records it: the lines first..last as context."""
    lines = CODE.splitlines()
    return {"file": "train.py", "line": 0, "context": {"start": first, "lines": lines[first - 1:last]}}


def test_the_assignment_above_in_the_same_block_is_found_and_can_be_replaced():
    defs = crossline.Definitions(_source(1, 9), 5)
    d = defs.find("dens")
    assert d is not None and d.line == 4 and d.statement.startswith("dens = pi * torch.exp(")
    assert d.src(d.value) == "pi * torch.exp(-0.5 * z ** 2) / sigma"
    assert d.reused is False  # after the culprit's line only `return nll.mean()`, then the block ends
    assert defs.find("pi") is None  # bound by a tuple: not a definition to rewrite
    assert defs.find("y") is None  # a parameter: no assignment in the block


def test_a_name_rebound_in_a_nested_block_or_read_later_is_not_taken_as_a_plain_definition():
    defs = crossline.Definitions(_source(9, 14), 13)
    assert defs.find("dens") is None  # `dens = dens * 2` inside the if: which value reaches line 13 is not one line
    plain = crossline.Definitions({"file": "t.py", "line": 0, "context": {"start": 1, "lines": [
        "def f(x):", "    dens = x.exp()", "    total = torch.log(dens.sum(-1))", "    return total + dens.mean()"]}}, 3)
    d = plain.find("dens")
    assert d is not None and d.reused is True  # the line after reads it too: it must stay defined


def test_a_fresh_name_is_not_one_the_recorded_lines_use():
    defs = crossline.Definitions(_source(1, 9), 5)
    assert defs.fresh("dens") == "dens_2" and defs.fresh("log_dens") == "log_dens"
    assert defs.fresh("log_dens") == "log_dens_2"  # nor one already handed out
