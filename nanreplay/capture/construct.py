"""Where the user's code built each `nn.Sequential`: the line a fix must edit when the culprit is a module the
user created but a library container calls.

An `nn.Sigmoid()` inside `nn.Sequential(...)` runs from torch's code: no op it runs has a line of the user's, so a
fix that removes it ("return the logits, use BCE with logits") had nowhere to go. The construction line is found
with evidence, on the failure path only (a snapshot is being written): the source files the step's recorded frames
name and the files that define the model's own classes are parsed, and a `Sequential(...)` call matches a module
when its positional arguments are calls of exactly the module's children's classes, in order. A module is recorded
only where exactly one call in those files matches it. The record is the statement that holds the call (its lines,
at most 31), where the call starts in it, and the container's path; nothing else.

This module imports only torch, the standard library and usersource.py (which reads and parses the files).
"""

from __future__ import annotations

import ast

import torch.nn as nn

from nanreplay.capture.usersource import Sources, module_class_files, readable

MAX_FILES = 20
MAX_LINES = 31  # the statement's lines kept (a snapshot frame's context holds at most this many)
MAX_RECORDS = 50


def _callee(node: ast.AST) -> str:
    f = node.func if isinstance(node, ast.Call) else None
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _files(model: nn.Module, program: dict | None) -> list[str]:
    """The files the step's recorded frames name, then those of the model's classes (usersource.py)."""
    out = [f["file"] for f in (program or {}).get("frames") or [] if isinstance(f, dict)
           and isinstance(f.get("file"), str)]
    seen, files = set(), []
    for f in out + module_class_files(model):
        if f and f not in seen:
            seen.add(f)
            if readable(f):
                files.append(f)
    return files[:MAX_FILES]


def _statements(tree: ast.AST):
    """(call, the smallest simple statement holding it) for every Sequential(...) call."""
    compound = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.With, ast.Try)
    for stmt in ast.walk(tree):
        if not isinstance(stmt, ast.stmt) or isinstance(stmt, compound):
            continue
        for n in ast.walk(stmt):
            if isinstance(n, ast.Call) and _callee(n) == "Sequential":
                yield n, stmt


def _matches(call: ast.Call, seq: nn.Sequential) -> bool:
    kids = list(seq.children())
    if call.keywords or len(call.args) != len(kids) or not kids:
        return False
    return all(isinstance(a, ast.Call) and _callee(a) == type(k).__name__ for a, k in zip(call.args, kids, strict=True))


def records(model: nn.Module, program: dict | None, sources: Sources | None = None) -> list[dict] | None:
    """[{module, file, line, function, code, context: [first, lines], call: [line, col]}] for each Sequential of
    the model whose construction is found in exactly one place; None when there is none. Never raises."""
    try:
        seqs = [(name, m) for name, m in model.named_modules() if type(m) is nn.Sequential]
        if not seqs:
            return None
        found: dict[str, list] = {name: [] for name, _ in seqs}
        sources = sources or Sources()
        for path in _files(model, program):
            got = sources.parse(path)
            if got is None:
                continue
            lines, tree = got
            for call, stmt in _statements(tree):
                for name, m in seqs:
                    if _matches(call, m):
                        found[name].append((path, call, stmt, lines))
        out = []
        for name, hits in found.items():
            if len(hits) != 1:
                continue
            path, call, stmt, lines = hits[0]
            first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
            if last - first + 1 > MAX_LINES:
                continue
            text = [ln.rstrip("\n") for ln in lines[first - 1:last]]
            out.append({"module": name, "file": path, "line": first, "function": "", "code": text[0].strip() or None,
                        "context": [first, text], "call": [call.lineno, call.col_offset]})
            if len(out) >= MAX_RECORDS:
                break
        return out or None
    except Exception:  # noqa: BLE001 - an observer never raises into the loop
        return None
