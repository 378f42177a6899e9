"""Fixes that span lines: the value the culprit's line reads was made by an earlier statement.

`dens = torch.exp(a) / b` on one line and `torch.log((pi * dens).sum(-1))` on the next is one composition,
log(sum(w * exp(a))), written across two statements. Its exact form needs both changed: the earlier line
makes `log_dens = a - torch.log(b)` instead, the culprit's line takes `torch.logsumexp(log_dens + ...)`.

`Definitions` finds, in the source lines the snapshot recorded (never more), the simple assignment
`name = expr` that the culprit's line reads: the nearest one above it, in the same block (same indentation,
no `def`/`class` in between), with no other binding of the name in between. A rule's transform asks it
for a name's definition while it rewrites the culprit's call, and registers the earlier line's new text with
`replace`; the rule hangs `edits` on the culprit line's `Rewrite` (`rewrite.extra`), and the fix carries
every edit (`Fix.edits`, the JSON's `fix.edits`). Where a name is still read after the rewrite (another line
uses it, or the recorded lines end before the function does), its assignment is kept, made from the new one.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass

from nanreplay.diagnose.edits import codefix


@dataclass
class Definition:
    name: str
    value: ast.AST  # the assigned expression
    src: Callable[[ast.AST], str]  # the source text of any node of it
    line: int  # the assignment's (absolute) line
    statement: str  # the assignment as written, dedented
    reused: bool  # the name may be read somewhere other than the culprit's statement: keep it defined


def _indent(text: str) -> int:
    return len(text) - len(text.lstrip())


class Definitions:
    """The assignments the culprit's line (`line` of `source`) reads, and the edits of them a fix makes."""

    def __init__(self, source: dict | None, line: int | None):
        self.source, self.line = source, line
        self.edits: list[codefix.Rewrite] = []
        self.names: set[str] = set()

    def _lines(self) -> tuple[int, list[str]] | None:
        got = codefix.source_lines(self.source) if self.line else None
        return got if got and got[0] <= self.line < got[0] + len(got[1]) else None

    def find(self, name: str) -> Definition | None:
        got = self._lines()
        if got is None or not name.isidentifier():
            return None
        start, lines = got
        here = lines[self.line - start]
        other = re.compile(rf"(^|[^\w.]){re.escape(name)}\s*([-+*/@%&|^]|//|\*\*|>>|<<)=|"
                           rf"\bfor\b[^:]*\b{re.escape(name)}\b|\bas\s+{re.escape(name)}\b|:=")

        def binds(text: str) -> bool:
            lhs = re.match(r"^\s*([\w\s,()\[\]*:]*?)=(?!=)", text)
            return bool(lhs and name in re.findall(r"\w+", lhs.group(1))) or bool(other.search(text))
        simple = re.compile(rf"^\s*{re.escape(name)}\s*(:[^=]+)?=(?!=)")
        for at in range(self.line - 1, start - 1, -1):
            text = lines[at - start]
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            if text.lstrip().startswith(("def ", "class ", "async def ")) or _indent(text) < _indent(here):
                return None  # left the block the culprit's line is in
            if not binds(text):
                continue
            if not simple.match(text) or _indent(text) != _indent(here):
                return None  # bound some other way (a tuple, +=, a loop) or in a nested block
            return self._definition(name, at, start, lines)
        return None

    def _definition(self, name: str, at: int, start: int, lines: list[str]) -> Definition | None:
        parsed = codefix._parse(start, lines, at, whole=False)
        if parsed is None:
            return None
        node = next((n for n in parsed.tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                     and n.lineno == parsed.rel(at)), None)
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]) if node is not None else []
        if node is None or node.value is None or len(targets) != 1 or \
                not (isinstance(targets[0], ast.Name) and targets[0].id == name):
            return None
        src = codefix.source_of_nodes(parsed)
        statement = "\n".join(parsed.text.splitlines()[node.lineno - 1:node.end_lineno])
        last = at + node.end_lineno - node.lineno
        return Definition(name, node.value, src, at, codefix._dedent(statement),
                          self._reused(name, last, start, lines))

    def _reused(self, name: str, last: int, start: int, lines: list[str]) -> bool:
        """Is `name` read after its assignment (ending on line `last`) other than by the culprit's statement?"""
        parsed = codefix._parse(start, lines, self.line, whole=False)
        if parsed is None:
            return True
        stmt = next((n for n in parsed.tree.body if n.lineno <= parsed.rel(self.line) <= n.end_lineno), None)
        if stmt is None:
            return True
        lo, hi = parsed.first + stmt.lineno - 1, parsed.first + stmt.end_lineno - 1
        word = re.compile(rf"(^|[^\w.]){re.escape(name)}\b")
        depth = _indent(lines[self.line - start])
        for at in range(last + 1, start + len(lines)):
            if lo <= at <= hi:
                continue
            text = lines[at - start]
            if text.strip() and _indent(text) < depth:
                return False  # the block ended: nothing after it reads this name
            if word.search(text.split("#", 1)[0]):
                return True
        return not isinstance(stmt, ast.Return)  # the recorded lines end inside the block: unknown, unless it returned

    def fresh(self, base: str) -> str:
        """A new variable name made from `base`, not used in the recorded lines."""
        got = self._lines()
        text = "\n".join(got[1]) if got else ""
        name, k = base, 2
        while re.search(rf"\b{re.escape(name)}\b", text) or name in self.names:
            name, k = f"{base}_{k}", k + 1
        self.names.add(name)
        return name

    def replace(self, d: Definition, new_lines: list[str]) -> None:
        """The fix changes `d`'s assignment into `new_lines` (same indentation)."""
        self.edits.append(codefix.Rewrite(before=d.statement, after="\n".join(new_lines), line=d.line,
                                          file=(self.source or {}).get("file"), first=d.line))

    def attach(self, rw: codefix.Rewrite | None) -> codefix.Rewrite | None:
        """The culprit line's rewrite with the edits of the earlier lines it needs."""
        if rw is not None:
            rw.extra = list(self.edits)
        return rw


def covers(rw: codefix.Rewrite | None, lines: list[int | None]) -> bool:
    """Does the rewrite change every line in `lines` (the lines of the ops its replay patches)? A patch that
    computes the rewritten expression stands for the edits only where each op it intercepts is on an edited
    line: else the code shown and the code replayed could differ."""
    if rw is None:
        return False
    spans = [(r.first or r.line, (r.first or r.line) + r.before.count("\n")) for r in (rw, *rw.extra)]
    return all(ln is not None and any(a <= ln <= b for a, b in spans) for ln in lines)
