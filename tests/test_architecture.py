"""The shape of the package, pinned: no import circles (not even through function-local imports),
no source file over 600 lines, no grab-bag modules, and the training side stays light."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "nanreplay"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every nanreplay module `path` imports, at any depth of the file (function-local imports too).

    `from pkg import sub` where `pkg.sub` is a module is an edge to `pkg.sub`; where it is an attribute,
    to `pkg` (whose __init__ must then be complete). Ancestor packages of the importer are not edges:
    Python initialises them first whatever the file says.
    """
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")))}
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                targets.append(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
        for t in targets:
            if t in known and t != name and t not in ancestors:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(p, m, known) for m, p in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if state.get(n) is None:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if state.get(m) is None:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycles():
    graph = _graph()
    assert graph["nanreplay.analysis.pipeline"], "the import graph came out empty: the parser is broken"
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
    # the checker itself finds a circle through a package's __init__ (formats -> native -> formats)
    graph["nanreplay.formats.native"] = graph["nanreplay.formats.native"] | {"nanreplay.formats"}
    assert _cycle(graph) is not None


def test_no_source_file_over_the_limit():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_no_grab_bag_modules():
    assert not [p for p in PKG.rglob("*.py") if p.stem in ("utils", "helpers", "misc", "common")]


def test_training_side_imports_only_torch():
    code = ("import sys; import nanreplay; from nanreplay import NanGuard; "
            "heavy = [m for m in ('pandas', 'jinja2', 'click', 'markupsafe', 'lightning', 'pytorch_lightning', "
            "'transformers', 'accelerate') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing NanGuard pulled in {out}"


def test_analyze_and_its_report_do_not_import_pandas(tmp_path):
    """pandas costs ~0.3 s and ~33 MB: triage's CSV uses it, one analysis and its report must not."""
    snap = ROOT / "sample_snapshots" / "zero_norm.pt"
    code = ("import sys; from nanreplay.cli import main\n"
            f"try: main(['analyze', {str(snap)!r}, '--json', 'a.json', '-o', 'r.html', '--markdown', 'r.md'])\n"
            "except SystemExit as e: assert not e.code, e.code\n"
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False" and (tmp_path / "r.html").stat().st_size > 0
