"""The HTML report and the terminal summary.

Compute first, render second (coverage.py's `html.py` is the model): `build_view()`
turns an `Analysis` into view-model dataclasses — every number formatted, every
highlight decided, every chart's geometry computed — and the jinja2 template only
lays them out. Autoescape is on, so no string that came from a snapshot or a model
(module names, file paths, keys, metadata) can become markup; the page also carries
a Content-Security-Policy that allows no network request and no script but its own.

The few helpers the template may call sit in one dict, `TEMPLATE_GLOBALS`. Chart
geometry (inline SVG, no plotting library) comes from `nanreplay.charts`.

The terminal summary is built from the same `Banner` object as the report's top
block, so the two cannot disagree.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanreplay import atomic
from nanreplay.analysis.contract import Analysis
from nanreplay.errors import OutputError
from nanreplay.report import charts

# ------------------------------------------------------------------ limits

SOURCE_CONTEXT = 3  # lines shown above and below the culprit line
MAX_SOURCE_BYTES = 2_000_000  # never read a bigger "source file" for context
COLLAPSE_RUN = 3  # chain: runs of more propagation events than this are collapsed
MAX_CHAIN_ROWS = 400  # chain events rendered in all (the JSON keeps every one)
MAX_BARS = 240  # activation chart: more module calls are merged into buckets
MAX_TABLE_ROWS = 1000  # gradient / shape tables: worst rows kept, the rest counted
MAX_HISTORY = 2000  # training-history points drawn
SPIKE_FACTOR = 10.0  # a grad norm this many times the median of the steps before it is a spike

# ------------------------------------------------------------------ formatting (also template globals)

_NONFINITE_TEXT = {"nan": "NaN", "inf": "+Inf", "-inf": "−Inf"}


def to_float(x: Any) -> float | None:
    """A JSON number or one of stats.jsonable's strings ("nan", "inf", "-inf") as a float; else None."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str) and x in _NONFINITE_TEXT:
        return float(x)
    return None


def num(x: Any, digits: int = 4) -> str:
    """A number for people: 4 significant digits, NaN/+Inf/−Inf spelled out, '—' for none."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, str):
        return _NONFINITE_TEXT.get(x, x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "+Inf" if x > 0 else "−Inf"
        if x == 0:
            return "0"
        return f"{x:.{digits}g}"
    return str(x)


def sort_key(x: Any, *, missing: float = -math.inf) -> str:
    """A value the page's table sorter parses with parseFloat: NaN sorts as the worst (largest)."""
    f = to_float(x)
    if f is None:
        f = missing
    if math.isnan(f):
        return "Infinity"
    if math.isinf(f):
        return "Infinity" if f > 0 else "-Infinity"
    return repr(f)


def fmt_shape(s: Any) -> str:
    if s is None:
        return "—"
    if isinstance(s, (list, tuple)):
        return "scalar" if not s else "×".join(str(d) for d in s)
    return str(s)


def module_label(m: str | None, model_class: str | None = None) -> str:
    if m is None:
        return "(outside any module)"
    if m == "":
        return f"<root> ({model_class})" if model_class else "<root>"
    if m == "<loss>":
        return "<loss>"
    return m


def where(src: dict | None) -> str:
    return f"{src.get('file')}:{src.get('line')}" if src else ""


def op_base(op: str | None) -> str:
    """'aten.div.Tensor' -> 'div', 'aten.mul_.Tensor' -> 'mul'."""
    if not op:
        return ""
    parts = op.split(".")
    base = parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]
    return base.rstrip("_") or base


def _dtype_max(dtype: str | None) -> float | None:
    if not dtype:
        return None
    import torch

    t = getattr(torch, dtype, None)
    if not isinstance(t, torch.dtype) or not t.is_floating_point:
        return None
    return float(torch.finfo(t).max)


TEMPLATE_GLOBALS: dict[str, Any] = {"num": num, "fmt_shape": fmt_shape}

# ------------------------------------------------------------------ view model: small pieces


@dataclass
class Badge:
    text: str
    tone: str  # ok | bad | warn | muted
    title: str = ""


@dataclass
class Cell:
    text: str
    bad: bool = False
    sort: str | None = None  # numeric sort value for the table sorter
    title: str = ""


@dataclass
class Fact:
    label: str
    value: str
    code: bool = False  # show the value as code
    tone: str = ""


@dataclass
class Section:
    id: str
    title: str


# ------------------------------------------------------------------ banner


@dataclass
class DiffLine:
    sign: str  # "-" or "+"
    text: str


@dataclass
class FixView:
    kind: str
    label: str  # "epsilon, ε = 1e-09"
    diff: list[DiffLine]  # before/after, when the fix is a change of the user's line
    code: str  # otherwise the code to add or change
    badge: Badge
    verification: str  # what the replay said, or why the fix was not replayed
    reasoning: str


@dataclass
class Banner:
    verdict: str
    verdict_label: str
    tone: str  # bad | ok | warn
    headline: str
    subline: str
    cause: str
    explanation: str
    facts: list[Fact]
    fix: FixView | None
    other_fixes: list[FixView]
    snapshot: str
    no_fix: str = ""  # said instead of a fix when a culprit has none


_VERDICT_LABEL = {
    "culprit_found": "culprit found",
    "nonfinite_input": "NaN/Inf in the input batch",
    "nonfinite_parameters": "NaN/Inf already in the weights",
    "not_reproduced": "not reproduced",
}


def _kind_text(kind: str | None, out: dict | None = None) -> str:
    if kind == "nan":
        return "NaN"
    if kind == "inf" and out:
        pos, neg = out.get("posinf", 0), out.get("neginf", 0)
        if pos and not neg:
            return "+Inf"
        if neg and not pos:
            return "−Inf"
    return "Inf" if kind == "inf" else (kind or "non-finite")


def _badge(fix: dict) -> Badge:
    v = fix.get("verified")
    if v is True:
        return Badge("✓ verified by replay", "ok", "the step was replayed with this fix: loss and every gradient finite")
    if v is False:
        return Badge("✗ did not verify", "bad", "the step was replayed with this fix and was still non-finite")
    if fix.get("verification"):
        return Badge("not verified", "muted")
    return Badge("not replayed", "muted", "fix verification was skipped (--no-verify)")


def fix_view(fix: dict) -> FixView | None:
    kind = fix.get("kind")
    if not kind or kind == "none":
        return None
    label = kind.replace("_", " ")
    if fix.get("epsilon") is not None:
        label += f", ε = {fix['epsilon']:g}" if isinstance(fix["epsilon"], (int, float)) else f", ε = {fix['epsilon']}"
    diff: list[DiffLine] = []
    if fix.get("before") and fix.get("after"):
        diff = [DiffLine("-", ln) for ln in str(fix["before"]).splitlines()]
        diff += [DiffLine("+", ln) for ln in str(fix["after"]).splitlines()]
    verification = fix.get("verification") or ""
    if not verification and fix.get("verified") is None:
        verification = "not replayed: fix verification was skipped (--no-verify)"
    return FixView(kind=kind, label=label, diff=diff, code="" if diff else str(fix.get("code") or ""),
                   badge=_badge(fix), verification=verification, reasoning=fix.get("reasoning") or "")


def _failure_text(d: dict) -> str:
    f = d.get("failure")
    if not f:
        return ""
    kind = _kind_text(f.get("kind"))
    if f.get("what") == "loss":
        return f"the loss became {kind}"
    loss = d.get("loss")
    finite = to_float(loss) is not None and math.isfinite(to_float(loss))
    return f"the gradient of {f.get('name')} became {kind}" + (f" (the loss, {num(loss)}, was finite)" if finite else "")


def _anomaly_short(d: dict) -> str:
    am = d.get("anomaly_mode") or {}
    if am.get("raises") is None:
        return ""
    if not am["raises"]:
        return "would stay silent"
    agree = "the culprit's own node" if am.get("agrees_with_culprit") else "a later node than the culprit"
    return f"would raise at {am.get('node')} ({agree})"


def banner(d: dict) -> Banner:
    verdict = d["verdict"]
    diag = d.get("diagnosis") or {}
    c = d.get("culprit")
    model_class = (d.get("model") or {}).get("class")
    facts: list[Fact] = []
    tone = "bad"
    subline = ""
    if c:
        kind = _kind_text(c.get("kind"), c.get("output"))
        headline = f"{c.get('op')} produced {kind} in {c.get('phase')}"
        if c.get("backward_node"):
            subline = f"{c['backward_node']}, the gradient of {c.get('forward_op')}"
        facts.append(Fact("module", module_label(c.get("module"), model_class), code=True))
        src = c.get("source")
        if src:
            fn = f" in {src['function']}()" if src.get("function") else ""
            facts.append(Fact("source", f"{where(src)}{fn}", code=True))
        elif c.get("module") == "<loss>":
            facts.append(Fact("source", _loss_source_note(d), tone="muted"))
        else:
            facts.append(Fact("source", "no user source line recorded", tone="muted"))
    elif verdict in ("nonfinite_input", "nonfinite_parameters"):
        leaves = d.get("nonfinite_leaves") or []
        names = ", ".join(f"{r.get('name')} ({r.get('nan', 0)} NaN, {r.get('inf', 0)} Inf)" for r in leaves[:3])
        more = f" and {len(leaves) - 3} more" if len(leaves) > 3 else ""
        where_ = "the input batch" if verdict == "nonfinite_input" else "the weights"
        headline = f"NaN/Inf was already in {where_} before the step ran"
        subline = names + more
        facts.append(Fact("replay", "not run: no op of this step made the value", tone="muted"))
    elif d.get("failure"):
        tone = "warn"
        headline = f"The replay is non-finite ({_failure_text(d)}), but no op that made it was seen"
    else:
        tone = "ok"
        headline = "The step replayed finite: loss and every parameter gradient"
        if d.get("loss") is not None:
            subline = f"loss {num(d.get('loss'))}"
    fail = _failure_text(d)
    if fail:
        facts.append(Fact("failure", fail))
    am = _anomaly_short(d)
    if am:
        facts.append(Fact("anomaly mode", f"set_detect_anomaly(True) {am}"))
    fix = fix_view(diag.get("fix") or {})
    chosen = (diag.get("fix") or {}).get("code")
    others = [fv for f in diag.get("candidates") or [] if f.get("code") != chosen and (fv := fix_view(f))]
    no_fix = "No automatic fix for this pattern: the inputs table shows what the op saw." if c and not fix else ""
    return Banner(verdict=verdict, verdict_label=_VERDICT_LABEL.get(verdict, verdict.replace("_", " ")), tone=tone,
                  headline=headline, subline=subline, cause=diag.get("title") or "",
                  explanation=diag.get("explanation") or "", facts=facts, fix=fix, other_fixes=others,
                  snapshot=d.get("snapshot") or "", no_fix=no_fix)


def _loss_source_note(d: dict) -> str:
    loss = (d.get("model") or {}).get("loss")
    what = f"--loss {loss}" if loss else "the loss"
    return f"inside the loss function ({what}), library code: no line of yours"


# ------------------------------------------------------------------ anomaly mode

SEED_QUOTE = ("set_detect_anomaly(True) raises only on NaN values in backward output, not Inf. "
              "The same function can land in either bucket depending on its input.")


@dataclass
class AnomalyView:
    answer: str
    tone: str
    node: str | None
    where: str
    message: str | None
    paragraphs: list[str]
    quote_seed: bool
    seed_quote: str = SEED_QUOTE


def anomaly_view(d: dict) -> AnomalyView:
    am = d.get("anomaly_mode") or {}
    c = d.get("culprit")
    raises = am.get("raises")
    node = am.get("node")
    at = ""
    if am.get("forward_op"):
        at = f"{am['forward_op']}"
        if am.get("source"):
            at += f" at {where(am['source'])}"
        elif am.get("module") == "<loss>":
            at += " in the loss function"
    if raises is None:
        why = ("the NaN/Inf was already in the batch or the weights, so the step was not replayed"
               if d["verdict"] in ("nonfinite_input", "nonfinite_parameters") else "the step was not replayed")
        return AnomalyView("Not checked", "muted", None, "", None, [f"Not checked: {why}."], False)
    if not raises:
        if c and c.get("kind") == "inf":
            paras = [f"No. torch.autograd.set_detect_anomaly(True) would have stayed silent: the culprit made "
                     f"{_kind_text('inf', c.get('output'))}, and anomaly detection only checks backward outputs for "
                     "NaN. Only torch.isfinite() (on the loss and the gradients) catches Inf."]
            return AnomalyView("No", "bad", None, "", None, paras, True)
        paras = ["No. No backward node returned NaN in this step, so set_detect_anomaly(True) would not have "
                 "raised."]
        return AnomalyView("No", "bad" if c else "muted", None, "", None, paras, False)
    if am.get("agrees_with_culprit") or not c:
        paras = [f"Yes, at {node}" + (", the culprit's own autograd node." if c else ".")]
        if c and c.get("phase") == "forward":
            paras.append("The NaN was made in forward; anomaly mode names the backward node of that same forward op, "
                         "and its traceback points at the same forward call.")
        return AnomalyView("Yes", "ok", node, at, am.get("message"), paras, False)
    paras = [f"Yes, but late: it would have raised at {node}" + (f" ({at})" if at else "") +
             f", not at the culprit {c.get('op')}" + (f" ({c['backward_node']})" if c.get("backward_node") else "") + "."]
    if c.get("kind") == "inf":
        paras.append("The culprit made Inf, not NaN. Anomaly detection only checks backward outputs for NaN, so it "
                     "stays silent while the value is Inf and fires only where the Inf turns into NaN (0 × ∞, "
                     "∞ − ∞) — a later node, whose traceback points away from the line to fix.")
        return AnomalyView("Yes, at a later node", "warn", node, at, am.get("message"), paras, True)
    if c.get("phase") == "forward":
        paras.append("The NaN was made in forward; anomaly mode checks only backward outputs, so it fires at the "
                     "first backward node that returns NaN and its traceback points at that node's forward call, "
                     "not at the culprit.")
    return AnomalyView("Yes, at a later node", "warn", node, at, am.get("message"), paras, False)


# ------------------------------------------------------------------ source


@dataclass
class Token:
    text: str
    cls: str  # "" | kw | str | num | com | fn


@dataclass
class SourceLine:
    number: int | None
    tokens: list[Token]
    mark: str  # "" | "culprit" | "anomaly" | "upstream"


@dataclass
class SourceView:
    file: str
    line: int | None
    function: str
    lines: list[SourceLine]
    origin: str  # file | recorded | none
    note: str
    note_first: bool = False  # the note explains what the lines are (no line of the culprit's own)


_PY_TOKEN = re.compile(
    r"(?P<com>#.*)"
    r"|(?P<str>[rbuRBUfF]{0,2}(?:'''.*?'''|\"\"\".*?\"\"\"|'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"))"
    r"|(?P<num>\b\d[\d_]*(?:\.\d*)?(?:[eE][+-]?\d+)?\b|\.\d+(?:[eE][+-]?\d+)?)"
    r"|(?P<word>[A-Za-z_]\w*)"
)
_KEYWORDS = frozenset(
    "False None True and as assert async await break class continue def del elif else except finally for from "
    "global if import in is lambda nonlocal not or pass raise return try while with yield".split())


def highlight_python(line: str) -> list[Token]:
    """One line of Python as tokens for colouring: keywords, strings, numbers, comments, calls.

    Per line and regex-based on purpose: a few lines cut out of a file rarely tokenize
    as complete Python, and this only colours — it never hides text.
    """
    out: list[Token] = []
    pos = 0
    for m in _PY_TOKEN.finditer(line):
        if m.start() > pos:
            out.append(Token(line[pos:m.start()], ""))
        kind = m.lastgroup or ""
        text = m.group()
        if kind == "word":
            kind = "kw" if text in _KEYWORDS else ("fn" if line[m.end():m.end() + 1] == "(" else "")
        out.append(Token(text, kind))
        pos = m.end()
    if pos < len(line):
        out.append(Token(line[pos:], ""))
    return out


def _read_context(src: dict, extra: int | None = None) -> list[tuple[int, str]] | None:
    """The culprit's line with SOURCE_CONTEXT lines around it, read from the file, or None.

    Read only what is plausibly the recorded source: a .py file of sane size whose line
    still says what was recorded. A snapshot must not be able to make the report quote
    an arbitrary file (a path in an exported program's metadata, say).
    """
    path = src.get("path") or src.get("file")
    line = src.get("line")
    if not isinstance(path, str) or not isinstance(line, int) or line < 1 or not path.endswith(".py"):
        return None
    p = Path(path)
    try:
        if not p.is_file() or p.stat().st_size > MAX_SOURCE_BYTES:
            return None
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
    except (OSError, ValueError):
        return None
    if line > len(lines):
        return None
    code = src.get("code")
    if code and lines[line - 1].strip() != str(code).strip():
        return None  # the file changed since the analysis: the recorded line is the truth
    lo = max(1, line - SOURCE_CONTEXT)
    hi = min(len(lines), line + SOURCE_CONTEXT)
    if extra is not None and abs(extra - line) <= 2 * SOURCE_CONTEXT and 1 <= extra <= len(lines):
        lo, hi = min(lo, extra), max(hi, extra)
    return [(i, lines[i - 1].rstrip()) for i in range(lo, hi + 1)]


def _common_indent(lines: list[str]) -> int:
    ind = [len(s) - len(s.lstrip()) for s in lines if s.strip()]
    return min(ind) if ind else 0


def _upstream_source(d: dict) -> tuple[dict, list[tuple[int, str]] | None] | None:
    """For a culprit without a line of the user's: the chain's first event that has one (where its input came from)."""
    with_src = [e for e in d.get("chain") or [] if e.get("source")]
    e = next((e for e in with_src if e.get("role") in ("literal", "origin", "conversion")), None) or \
        next(iter(with_src), None)
    return (e, _read_context(e["source"])) if e else None


def source_view(d: dict) -> SourceView | None:
    c = d.get("culprit")
    if not c:
        return None
    src = c.get("source")
    if not src:
        if c.get("module") == "<loss>":
            loss = (d.get("model") or {}).get("loss")
            what = f"the loss function you named with --loss {loss}" if loss else "the loss function"
            note = (f"The culprit {c.get('op')} ran inside {what}: library code, not yours, so there is no source "
                    "line of yours to show for it.")
        else:
            note = ("No source line of yours was recorded for this op: it ran inside library code (or an exported "
                    "program without stack traces). The module path and the chain below locate it.")
        up = _upstream_source(d)
        if up is None:
            if c.get("module") == "<loss>":
                note += (" What reached the loss is in the inputs table below; the fix is usually upstream (the "
                         "model's output) or a numerically safer loss.")
            return SourceView("", None, "", [], "none", note, note_first=True)
        e, ctx = up
        usrc = e["source"]
        note += (f" The non-finite values it received come from your line {where(usrc)} "
                 f"({e.get('role')} {e.get('op')}), shown here.")
        if ctx:
            strip = _common_indent([t for _, t in ctx])
            lines = [SourceLine(i, highlight_python(t[strip:]), "upstream" if i == usrc.get("line") else "")
                     for i, t in ctx]
        else:
            lines = [SourceLine(usrc.get("line"), highlight_python(str(usrc.get("code") or "").strip()), "upstream")]
        return SourceView(str(usrc.get("file")), usrc.get("line"), usrc.get("function") or "", lines,
                          "file" if ctx else "recorded", note, note_first=True)
    line = src.get("line")
    am = d.get("anomaly_mode") or {}
    am_src = am.get("source") if am.get("raises") and not am.get("agrees_with_culprit") else None
    am_line = am_src.get("line") if am_src and am_src.get("path") == src.get("path") and \
        am_src.get("line") != line else None
    ctx = _read_context(src, am_line)
    if ctx:
        strip = _common_indent([t for _, t in ctx])
        lines = [SourceLine(i, highlight_python(t[strip:]),
                            "culprit" if i == line else ("anomaly" if i == am_line else "")) for i, t in ctx]
        note = "" if not am_line or not any(s.mark == "anomaly" for s in lines) else \
            f"Line {am_line} is where set_detect_anomaly(True) would have pointed instead."
        return SourceView(str(src.get("file")), line, src.get("function") or "", lines, "file", note)
    code = src.get("code") or ""
    note = ("The source file is not readable now (or has changed since the analysis); this is the line as recorded "
            "when the step was replayed.") if code else "The source line could not be read."
    lines = [SourceLine(line, highlight_python(str(code).strip()), "culprit")] if code else []
    return SourceView(str(src.get("file")), line, src.get("function") or "", lines, "recorded", note)


# ------------------------------------------------------------------ causal chain


@dataclass
class ChainEvent:
    index: int
    phase: str
    op: str
    node: str
    forward_op: str
    module: str
    role: str
    kind: str
    nan: int
    posinf: int
    neginf: int
    numel: int
    where: str
    code: str
    culprit: bool
    failure: bool


@dataclass
class ChainGroup:
    events: list[ChainEvent]
    collapsed: bool
    summary: str


@dataclass
class FlowStep:
    title: str
    detail: str
    role: str  # origin | conversion | literal | propagation | failure | more
    kind: str


@dataclass
class ChainView:
    flow: list[FlowStep]
    groups: list[ChainGroup]
    total: int
    shown: int


def _event(e: dict, culprit_index: int | None, failure_index: int | None) -> ChainEvent:
    src = e.get("source")
    return ChainEvent(index=e.get("index", -1), phase=e.get("phase", ""), op=e.get("op", ""),
                      node=e.get("backward_node") or "", forward_op=e.get("forward_op") or "",
                      module=module_label(e.get("module")), role=e.get("role", ""),
                      kind=e.get("kind", ""), nan=e.get("nan", 0), posinf=e.get("posinf", 0),
                      neginf=e.get("neginf", 0), numel=e.get("numel", 0), where=_short_where(src),
                      code=f"{where(src)}: {(src or {}).get('code') or ''}" if src else "",
                      culprit=e.get("index") == culprit_index, failure=e.get("index") == failure_index)


def _short_where(src: dict | None) -> str:
    return f"{Path(str(src.get('file'))).name}:{src.get('line')}" if src else ""


def _run_summary(run: list[ChainEvent]) -> str:
    ops: dict[str, int] = {}
    for e in run:
        ops[op_base(e.op)] = ops.get(op_base(e.op), 0) + 1
    top = ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:6])
    mods = sorted({e.module for e in run})
    where_ = f" in {', '.join(mods[:3])}" + (f" and {len(mods) - 3} more modules" if len(mods) > 3 else "")
    return f"{len(run)} propagation steps{where_} ({top}{', …' if len(ops) > 6 else ''})"


def chain_view(d: dict) -> ChainView | None:
    chain = d.get("chain") or []
    if not chain:
        return None
    c = d.get("culprit")
    culprit_index = c.get("event") if c else None
    failure_index = (d.get("failure") or {}).get("event")
    events = [_event(e, culprit_index, failure_index) for e in chain]

    def keep(i: int, e: ChainEvent) -> bool:  # always visible: the story's turning points and its ends
        return e.role != "propagation" or e.culprit or e.failure or i == 0 or i == len(events) - 1

    groups: list[ChainGroup] = []
    run: list[ChainEvent] = []

    def flush() -> None:
        if not run:
            return
        if len(run) > COLLAPSE_RUN:
            groups.append(ChainGroup(list(run), True, _run_summary(run)))
        else:
            groups.extend(ChainGroup([e], False, "") for e in run)
        run.clear()

    for i, e in enumerate(events):
        if keep(i, e):
            flush()
            groups.append(ChainGroup([e], False, ""))
        else:
            run.append(e)
    flush()

    # Cap what is rendered: a huge run keeps its first and last events (the JSON keeps all).
    shown = 0
    budget = MAX_CHAIN_ROWS
    for g in groups:
        if g.collapsed and len(g.events) > budget // 2 > 0:
            half = max(1, budget // 4)
            dropped = len(g.events) - 2 * half
            g.summary += f"; {dropped} in the middle not shown (see --json)"
            g.events = g.events[:half] + g.events[-half:]
        shown += len(g.events)
        budget = max(0, budget - len(g.events))

    flow: list[FlowStep] = []
    skipped = 0
    for e in events:
        if e.role == "propagation":
            skipped += 1
            continue
        if skipped:
            flow.append(FlowStep(f"{skipped} propagation", "", "more", ""))
            skipped = 0
        flow.append(FlowStep(op_base(e.op), f"{e.node or e.phase} · {e.module}", e.role, _kind_text(e.kind)))
    if skipped:
        flow.append(FlowStep(f"{skipped} propagation", "", "more", ""))
    f = d.get("failure")
    if f:
        what = "the loss" if f.get("what") == "loss" else f"grad of {f.get('name')}"
        flow.append(FlowStep(what, "the failure", "failure", _kind_text(f.get("kind"))))
    if len(flow) > 12:
        flow = flow[:5] + [FlowStep(f"{len(flow) - 10} more steps", "", "more", "")] + flow[-5:]
    return ChainView(flow=flow, groups=groups, total=len(events), shown=shown)


# ------------------------------------------------------------------ culprit inputs / output

_ZERO_BAD = frozenset({"div", "sqrt", "rsqrt", "log", "log2", "log10", "reciprocal", "pow", "_softmax_backward_data",
                       "norm", "linalg_vector_norm", "atan2", "xlogy", "special_xlogy", "lgamma", "digamma",
                       "_log_softmax_backward_data"})
_NEG_BAD = frozenset({"sqrt", "rsqrt", "log", "log2", "log10", "pow", "lgamma", "digamma", "acos", "asin"})
_EXP_LIKE = frozenset({"exp", "exp2", "expm1", "sinh", "cosh", "softplus"})
_NEAR_OVERFLOW = 0.1


@dataclass
class StatsRow:
    label: str
    cells: list[Cell]


@dataclass
class StatsView:
    columns: list[str]
    rows: list[StatsRow]
    output: list[Fact]
    output_bad: bool
    scalars: str
    notes: list[str]


def stats_view(d: dict) -> StatsView | None:
    c = d.get("culprit")
    if not c:
        return None
    base = op_base(c.get("op"))
    zero_bad = base in _ZERO_BAD
    neg_bad = base in _NEG_BAD
    notes: list[str] = []
    rows = []
    for i, s in enumerate(c.get("inputs") or []):
        dtype = s.get("dtype")
        dmax = _dtype_max(dtype)
        absmax = to_float(s.get("absmax"))
        near = bool(dmax and absmax is not None and absmax >= _NEAR_OVERFLOW * dmax)
        if base in _EXP_LIKE and dmax and absmax is not None and (to_float(s.get("max")) or 0) > math.log(dmax):
            near = True
            notes.append(f"exp overflows {dtype} above {math.log(dmax):.4g}; input {i} reaches {num(s.get('max'))}.")
        # for a division only the denominator's zeros matter
        zeros_bad = bool(s.get("zeros")) and zero_bad and (base != "div" or i >= 1)
        if base == "mul" and s.get("zeros") and any((x.get("inf") or 0) for x in c.get("inputs") or []):
            zeros_bad = True  # 0 × ∞
        rows.append(StatsRow(f"input {i}", [
            Cell(fmt_shape(s.get("shape"))), Cell(str(dtype)),
            Cell(num(s.get("min")), bad=near and (to_float(s.get("min")) or 0) < 0),
            Cell(num(s.get("max")), bad=near and (to_float(s.get("max")) or 0) > 0),
            Cell(num(s.get("absmin_nonzero"))),
            Cell(num(s.get("zeros")), bad=zeros_bad),
            Cell(num(s.get("negatives")), bad=bool(s.get("negatives")) and neg_bad),
            Cell(num(s.get("nan")), bad=bool(s.get("nan"))),
            Cell(num(s.get("inf")), bad=bool(s.get("inf"))),
        ]))
    out = c.get("output") or {}
    output = [Fact("elements", num(out.get("numel"))),
              Fact("NaN", num(out.get("nan")), tone="bad" if out.get("nan") else ""),
              Fact("+Inf", num(out.get("posinf")), tone="bad" if out.get("posinf") else ""),
              Fact("−Inf", num(out.get("neginf")), tone="bad" if out.get("neginf") else "")]
    low = sorted({s.get("dtype") for s in c.get("inputs") or []} & {"float16", "bfloat16"})
    if low and c.get("kind") == "inf":
        notes.append(", ".join(f"{t} holds at most {num(_dtype_max(t), 5)}" for t in low) +
                     ": a result beyond that becomes Inf even when every input is modest.")
    scalars = ", ".join(str(x) if isinstance(x, bool) or not isinstance(x, (int, float, str)) else num(x)
                        for x in c.get("scalars") or [])
    cols = ["", "shape", "dtype", "min", "max", "smallest |x| ≠ 0", "zeros", "negatives", "NaN", "Inf"]
    return StatsView(cols, rows, output, bool(out.get("nan") or out.get("posinf") or out.get("neginf")), scalars,
                     notes)


# ------------------------------------------------------------------ charts (geometry in nanreplay.charts)


@dataclass
class ActivationView:
    chart: charts.BarChart
    caption: str
    notes: list[str]
    table: list[list[Cell]]  # the calls closest to their dtype's limit


def activation_view(d: dict) -> ActivationView | None:
    """The HF overflow debugger's data, drawn: max |activation| per module call, forward order, log scale."""
    rows = d.get("activations") or []
    if not rows:
        return None
    c = d.get("culprit") or {}
    cmod = c.get("module") if c else None
    model_class = (d.get("model") or {}).get("class")
    # merge consecutive calls into buckets when there are too many to draw one bar each
    k = max(1, math.ceil(len(rows) / MAX_BARS))
    items: list[charts.BarItem] = []
    for i in range(0, len(rows), k):
        chunk = rows[i:i + k]
        vals = [to_float(r.get("absmax")) for r in chunk]
        j = max(range(len(chunk)), key=lambda t: math.inf if vals[t] is None or math.isnan(vals[t]) else vals[t])
        mods = [r.get("module") for r in chunk]
        culprit = cmod is not None and cmod in mods
        label = module_label(mods[j])
        span = (f" ({len(chunk)} calls: {module_label(mods[0], model_class)} … {module_label(mods[-1], model_class)})"
                if len(chunk) > 1 else "")
        title = f"{label}{span}: max |activation| {num(chunk[j].get('absmax'))} ({chunk[j].get('dtype')})"
        if culprit:
            title += " — the culprit's module"
        v = vals[j]
        items.append(charts.BarItem(value=v if v is not None else math.nan, label=label, title=title,
                                    value_text=num(chunk[j].get("absmax"), 3).lstrip("+"),
                                    near=any(r.get("near_overflow") for r in chunk), culprit=culprit))
    dtypes = sorted({r.get("dtype") for r in rows if r.get("dtype")})
    limits = {f"{t} max {num(m, 5)}": m for t in dtypes if (m := _dtype_max(t))}
    chart = charts.log_bars(items, limits)
    notes = []
    if k > 1:
        notes.append(f"{len(rows)} module calls: each bar is the largest of {k} consecutive calls (hover for names).")
    if cmod == "<loss>":
        notes.append("The culprit ran in the loss function, after the last module: no bar is marked.")
    elif cmod is not None and c and not any(it.culprit for it in items):
        notes.append(f"The culprit's module {module_label(cmod, model_class)} returned no floating tensor: "
                     "no bar is marked.")
    n_bad = sum(1 for r in rows if (f := to_float(r.get("absmax"))) is None or not math.isfinite(f))
    caption = (f"max |activation| per module call in forward order, log scale; {len(rows)} calls"
               + (f", {n_bad} non-finite" if n_bad else "") + ".")
    worst = sorted(rows, key=lambda r: -(r.get("ratio") or (math.inf if r.get("near_overflow") else 0)))[:12]
    table = [[Cell(module_label(r.get("module"), model_class)),
              Cell(num(r.get("absmax")), bad=bool(r.get("near_overflow"))),
              Cell(str(r.get("dtype"))), Cell(num(r.get("ratio"), 3))] for r in worst]
    return ActivationView(chart, caption, notes, table)


@dataclass
class HistoryView:
    chart: charts.LineChart | None
    caption: str
    rows: list[list[Cell]]
    spike: str
    notes: list[str]


def _first_nonfinite(loss: list[float | None], gn: list[float | None]) -> int | None:
    for i, pair in enumerate(zip(loss, gn, strict=True)):
        if any(v is not None and not math.isfinite(v) for v in pair):
            return i
    return None


def _grad_spike(gn: list[float | None], until: int | None) -> int | None:
    """The first finite grad norm over SPIKE_FACTOR× the median of the steps before it (the seed's 1e6 signal)."""
    end = len(gn) if until is None else until + 1
    for i in range(3, end):
        prev = sorted(v for v in gn[:i] if v is not None and math.isfinite(v))
        v = gn[i]
        if len(prev) >= 3 and v is not None and math.isfinite(v):
            med = prev[len(prev) // 2]
            if med > 0 and v > SPIKE_FACTOR * med:
                return i
    return None


def history_view(d: dict) -> HistoryView | None:
    """Loss and grad norm over the steps a native snapshot recorded, the spike marked."""
    info = d.get("snapshot_info") or {}
    hist = [h for h in info.get("history") or [] if isinstance(h, dict)]
    if not hist:
        return None
    hist = hist[-MAX_HISTORY:]
    steps = [h["step"] if isinstance(h.get("step"), (int, float)) and not isinstance(h.get("step"), bool) else i
             for i, h in enumerate(hist)]
    loss = [to_float(h.get("loss")) for h in hist]
    gn = [to_float(h.get("grad_norm")) for h in hist]
    bad = _first_nonfinite(loss, gn)
    spike = _grad_spike(gn, bad)
    snap_step = info.get("step")
    rows = [[Cell(num(s)), Cell(num(h.get("loss")), bad=loss[i] is not None and not math.isfinite(loss[i])),
             Cell(num(h.get("grad_norm")), bad=(gn[i] is not None and not math.isfinite(gn[i])) or i == spike)]
            for i, (s, h) in enumerate(zip(steps, hist, strict=True))]
    texts, marks = [], []
    if spike is not None:
        prev = sorted(v for v in gn[:spike] if v is not None and math.isfinite(v))
        ratio = gn[spike] / prev[len(prev) // 2]
        texts.append(f"grad-norm spike at step {num(steps[spike])}: {num(gn[spike])}, {num(ratio, 3)}× the median "
                     "of the steps before")
        marks.append((steps[spike], f"spike (step {num(steps[spike])})"))
    if bad is not None:
        texts.append(f"non-finite from step {num(steps[bad])}")
        marks.append((steps[bad], f"non-finite (step {num(steps[bad])})"))
    notes = []
    if isinstance(snap_step, int) and snap_step not in steps:
        notes.append(f"The snapshot was written at step {snap_step}.")
    elif isinstance(snap_step, int) and (bad is None or steps[bad] != snap_step):
        marks.append((snap_step, f"snapshot (step {snap_step})"))
    chart = charts.step_lines(steps, [("loss", loss), ("grad norm", gn)], marks, num) if len(hist) >= 2 else None
    caption = f"loss and gradient norm over the {len(steps)} recorded steps before the snapshot."
    return HistoryView(chart, caption, rows, "; ".join(texts), notes)


# ------------------------------------------------------------------ gradients and shapes


@dataclass
class GradTable:
    rows: list[list[Cell]]
    total: int
    omitted: int
    nonfinite: int
    no_grad: int
    zero: int


def gradient_table(d: dict) -> GradTable | None:
    """The seed's per-parameter walk as a table, worst first (pandas builds and orders the frame)."""
    grads = d.get("gradients") or []
    if not grads:
        return None
    import pandas as pd

    cols = ["name", "shape", "dtype", "has_grad", "mean", "std", "max_abs", "nan", "inf", "grad_shape"]
    df = pd.DataFrame([{k: g.get(k) for k in cols} for g in grads], columns=cols)
    df["has_grad"] = df["has_grad"].fillna(False).astype(bool)
    df["nan"] = pd.to_numeric(df["nan"], errors="coerce").fillna(0).astype(int)
    df["inf"] = pd.to_numeric(df["inf"], errors="coerce").fillna(0).astype(int)
    df["bad"] = df["nan"] + df["inf"]
    df["max_f"] = [to_float(v) for v in df["max_abs"]]
    df["max_f"] = df["max_f"].astype(float).fillna(-1.0)
    df["zero"] = df["has_grad"] & (df["max_f"] == 0.0) & (df["bad"] == 0)
    df["rank"] = 0
    df.loc[df["zero"], "rank"] = 1
    df.loc[~df["has_grad"], "rank"] = 2
    df.loc[df["bad"] > 0, "rank"] = 3
    df = df.sort_values(["rank", "bad", "max_f", "name"], ascending=[False, False, False, True], kind="stable")
    total = len(df)
    shown = df.head(MAX_TABLE_ROWS)
    rows = []
    for r in shown.itertuples(index=False):
        if not r.has_grad:
            status = Cell("NO GRADIENT", bad=False, sort="2")
            stats = [Cell("—", sort="-Infinity") for _ in range(3)]
        else:
            label = ("NaN + Inf" if r.nan and r.inf else "NaN" if r.nan else "Inf" if r.inf
                     else "all zero" if r.zero else "finite")
            status = Cell(label, bad=bool(r.bad), sort={3: "3", 1: "1"}.get(int(r.rank), "0"))
            stats = [Cell(num(r.mean), bad=to_float(r.mean) is not None and not math.isfinite(to_float(r.mean)),
                          sort=sort_key(r.mean)),
                     Cell(num(r.std), bad=to_float(r.std) is not None and not math.isfinite(to_float(r.std)),
                          sort=sort_key(r.std)),
                     Cell(num(r.max_abs), bad=to_float(r.max_abs) is not None and not math.isfinite(to_float(r.max_abs)),
                          sort=sort_key(r.max_abs))]
        rows.append([Cell(str(r.name)), Cell(fmt_shape(r.shape), sort=None), status, *stats,
                     Cell(num(int(r.nan)), bad=bool(r.nan), sort=str(int(r.nan))),
                     Cell(num(int(r.inf)), bad=bool(r.inf), sort=str(int(r.inf)))])
    return GradTable(rows, total, total - len(shown), int((df["bad"] > 0).sum()), int((~df["has_grad"]).sum()),
                     int(df["zero"].sum()))


@dataclass
class ShapeTable:
    rows: list[list[Cell]]
    total: int
    mismatches: int
    no_grad: int
    omitted: int


def shape_table(d: dict) -> ShapeTable | None:
    rows_in = d.get("gradient_shapes") or []
    if not rows_in:
        return None
    model_class = (d.get("model") or {}).get("class")
    seen: dict[str, int] = {}
    rows = []
    for r in rows_in:
        m = r.get("module")
        seen[m] = seen.get(m, 0) + 1
        label = module_label(m, model_class) + (f" (call {seen[m]})" if seen[m] > 1 else "")
        if r.get("grad_shape") is None:
            status, bad, rank = "no gradient reached this output", False, 1
        elif r.get("mismatch"):
            status, bad, rank = "MISMATCH", True, 2
        else:
            status, bad, rank = "ok", False, 0
        rows.append((rank, [Cell(label), Cell(fmt_shape(r.get("output_shape"))),
                            Cell(fmt_shape(r.get("grad_shape")), bad=bad), Cell(status, bad=bad)]))
    mism = sum(1 for rank, _ in rows if rank == 2)
    nog = sum(1 for rank, _ in rows if rank == 1)
    ordered = sorted(rows, key=lambda t: -t[0])  # stable: flagged rows first, call order within
    kept = [cells for _, cells in ordered[:MAX_TABLE_ROWS]]
    return ShapeTable(kept, len(rows), mism, nog, len(rows) - len(kept))


# ------------------------------------------------------------------ precision, environment, reproduce


@dataclass
class PrecisionView:
    rows: list[list[Cell]]
    sentence: str


def precision_view(d: dict) -> PrecisionView | None:
    rows_in = d.get("precision") or []
    if not rows_in:
        return None
    rows = []
    for r in rows_in:
        if "error" in r:
            rows.append([Cell(str(r.get("dtype"))), Cell("—"), Cell("—"), Cell(f"could not replay: {r['error']}")])
            continue
        ok = bool(r.get("loss_finite")) and bool(r.get("grads_finite"))
        rows.append([Cell(str(r.get("dtype"))),
                     Cell(num(r.get("loss")), bad=not r.get("loss_finite")),
                     Cell("finite" if r.get("grads_finite") else f"{num(r.get('nonfinite_grads'))} non-finite",
                          bad=not r.get("grads_finite")),
                     Cell("finite" if ok else "non-finite", bad=not ok)])
    sentence = (d.get("diagnosis") or {}).get("precision") or ""
    return PrecisionView(rows, sentence)


def environment_facts(d: dict) -> list[Fact]:
    env = d.get("environment") or {}
    model = d.get("model") or {}
    info = d.get("snapshot_info") or {}
    facts = [Fact("snapshot", d.get("snapshot") or "", code=True),
             Fact("snapshot format", str(info.get("format") or "—"))]
    keys = info.get("keys") or {}
    if keys:
        facts.append(Fact("snapshot keys", ", ".join(f"{k} = {v!s}" for k, v in keys.items()), code=True))
    for k, label in (("step", "step"), ("trigger", "trigger"), ("created", "written")):
        if info.get(k) is not None:
            facts.append(Fact(label, num(info[k])))
    if info.get("rank") is not None or info.get("world_size") is not None:
        facts.append(Fact("rank", f"{num(info.get('rank'))} of {num(info.get('world_size'))}"
                          if info.get("world_size") is not None else num(info.get("rank"))))
    facts.append(Fact("model rebuilt from", str(model.get("how") or "—"), code=True))
    if model.get("class"):
        params = f", {model['parameters']:,} parameters" if isinstance(model.get("parameters"), int) else ""
        facts.append(Fact("model", f"{model['class']}{params}"))
    if model.get("dtypes"):
        facts.append(Fact("parameter dtypes", ", ".join(map(str, model["dtypes"]))))
    facts.append(Fact("loss", str(model.get("loss") or "the model's own output (scalar)")))
    if model.get("autocast"):
        facts.append(Fact("autocast", ", ".join(f"{k}={v}" for k, v in model["autocast"].items())))
    if model.get("training") is not None:
        facts.append(Fact("mode", "train()" if model["training"] else "eval()"))
    facts += [Fact("device", str(env.get("device") or "—")), Fact("torch", str(env.get("torch") or "—")),
              Fact("python", str(env.get("python") or "—")), Fact("platform", str(env.get("platform") or "—")),
              Fact("nanreplay", str(d.get("nanreplay_version") or "—"))]
    st = d.get("stats") or {}
    t = (st.get("timings") or {}).get("total")
    if isinstance(t, (int, float)):
        ops = f", {st['ops_forward']} forward ops, {st.get('events', 0)} non-finite events" if "ops_forward" in st else ""
        facts.append(Fact("analysis", f"{t:.2f} s{ops}"))
    return facts


@dataclass
class ReproduceView:
    command: str
    snippet: str
    notes: list[str]


_DOTTED = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")


def reproduce_view(d: dict) -> ReproduceView:
    model = d.get("model") or {}
    env = d.get("environment") or {}
    how = str(model.get("how") or "")
    snap = d.get("snapshot") or "snapshot.pt"
    args = ["nanreplay", "analyze", snap]
    kwargs = [repr(snap)]
    notes = []
    inv = d.get("invocation")
    if inv is None:  # older JSON: reconstruct from how the model was rebuilt
        spec = how[len("--model "):] if how.startswith("--model ") else None
        inv = {"model": spec, "loss": model.get("loss") if spec else None, "trust": "--trust" in how}
    if inv.get("model"):
        args += ["--model", str(inv["model"])]
        kwargs.append(f"model={str(inv['model'])!r}")
        notes.append("Run it where the model's module is importable (the analysis ran with it on the path).")
    if inv.get("trust"):
        args.append("--trust")
        kwargs.append("trust=True")
    if inv.get("loss"):
        args += ["--loss", str(inv["loss"])]
        kwargs.append(f"loss={str(inv['loss'])!r}")
    dev = str(env.get("device") or "cpu")
    if dev != "cpu":
        args += ["--device", dev]
        kwargs.append(f"device={dev!r}")
    args += ["-o", "report.html", "--json", "analysis.json"]
    command = " ".join(shlex.quote(a) for a in args)
    snippet = "\n".join([
        "from nanreplay import analyze",
        "",
        f"a = analyze({', '.join(kwargs)})",
        "print(a.verdict)               # " + d["verdict"],
        "print(a.culprit and a.culprit['op'], a.culprit and a.culprit['source'])",
        "print(a.diagnosis['title'])",
        "print(a.diagnosis['fix']['code'], a.diagnosis['fix']['verified'])",
    ])
    return ReproduceView(command, snippet, notes)


# ------------------------------------------------------------------ leaves


@dataclass
class LeavesTable:
    rows: list[list[Cell]]
    note: str


def leaves_table(d: dict) -> LeavesTable | None:
    leaves = d.get("nonfinite_leaves") or []
    if not leaves:
        return None
    rows = []
    for r in leaves:
        samples = r.get("samples") or []
        role = str(r.get("role")) + (" (intentional constant, e.g. a mask: ignored)" if r.get("literal") else "")
        rows.append([Cell(str(r.get("name"))), Cell(role), Cell(fmt_shape(r.get("shape"))),
                     Cell(num(r.get("nan")), bad=bool(r.get("nan"))), Cell(num(r.get("inf")), bad=bool(r.get("inf"))),
                     Cell(", ".join(map(str, samples[:20])) + (" …" if len(samples) > 20 else "") if samples else "—")])
    note = ""
    if d["verdict"] == "culprit_found":
        note = "Buffers holding ±Inf and no NaN are treated as intentional constants (attention masks)."
    return LeavesTable(rows, note)


# ------------------------------------------------------------------ the whole page


@dataclass
class ReportView:
    title: str
    verdict: str
    banner: Banner
    warnings: list[str]
    anomaly: AnomalyView
    source: SourceView | None
    chain: ChainView | None
    stats: StatsView | None
    leaves: LeavesTable | None
    activations: ActivationView | None
    gradients: GradTable | None
    shapes: ShapeTable | None
    history: HistoryView | None
    precision: PrecisionView | None
    environment: list[Fact]
    reproduce: ReproduceView
    sections: list[Section] = field(default_factory=list)
    css: str = ""
    js: str = ""
    csp: str = ""


def build_view(a: Analysis | dict) -> ReportView:
    """Everything the page shows, computed: the template only lays this out."""
    d = a.to_json() if isinstance(a, Analysis) else a
    v = ReportView(
        title=f"nanreplay: {Path(str(d.get('snapshot') or 'snapshot')).name}",
        verdict=d["verdict"],
        banner=banner(d),
        warnings=[str(w) for w in d.get("warnings") or []],
        anomaly=anomaly_view(d),
        source=source_view(d),
        chain=chain_view(d),
        stats=stats_view(d),
        leaves=leaves_table(d),
        activations=activation_view(d),
        gradients=gradient_table(d),
        shapes=shape_table(d),
        history=history_view(d),
        precision=precision_view(d),
        environment=environment_facts(d),
        reproduce=reproduce_view(d),
    )
    present = [("verdict", "Verdict", True), ("anomaly", "Anomaly detection", True), ("source", "Source", v.source),
               ("chain", "Causal chain", v.chain), ("culprit-stats", "Culprit inputs", v.stats),
               ("leaves", "Non-finite leaves", v.leaves), ("activations", "Activations", v.activations),
               ("gradients", "Gradients", v.gradients), ("shapes", "Gradient shapes", v.shapes),
               ("history", "History", v.history), ("precision", "Precision", v.precision),
               ("environment", "Environment", True), ("reproduce", "Reproduce", True)]
    v.sections = [Section(i, t) for i, t, on in present if on]
    v.css, v.js = _asset("report.css"), _asset("report.js")
    v.csp = ("default-src 'none'; img-src data:; " f"style-src {_sha256(v.css)}; script-src {_sha256(v.js)}; "
             "base-uri 'none'; form-action 'none'")
    return v


# ------------------------------------------------------------------ rendering


def _template_dir() -> Path:
    return Path(__file__).parent / "templates"


def _asset(name: str) -> str:
    return (_template_dir() / name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


@functools.lru_cache(maxsize=1)
def jinja_env():
    """One jinja2 environment per process: templates compile once (triage renders many reports)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_template_dir())),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.globals.update(TEMPLATE_GLOBALS)
    return env


def render_html(a: Analysis | dict) -> str:
    from markupsafe import Markup

    v = build_view(a)
    # The page's own CSS and JS are trusted files shipped with nanreplay; inlined verbatim so their CSP hashes match.
    return jinja_env().get_template("report.html.j2").render(v=v, css=Markup(v.css), js=Markup(v.js))


def write_report(a: Analysis | dict, path: str) -> None:
    """Render, then write atomically: a failure at any point leaves no file (and no half of one) behind."""
    html = render_html(a)
    try:
        atomic.write_text(path, html)
    except OSError as e:
        raise OutputError(f"{path}: cannot write the report: {e.strerror or e}") from None


# ------------------------------------------------------------------ terminal


def terminal_summary(a: Analysis | dict, report_path: str | None) -> str:
    """The banner in a few lines, for the terminal."""
    d = a.to_json() if isinstance(a, Analysis) else a
    b = banner(d)
    lines = [f"nanreplay: {d.get('snapshot')}: {b.verdict_label}"]
    c = d.get("culprit")
    if c:
        how = c["phase"]
        if c.get("backward_node"):
            how += f", {c['backward_node']} ← {c.get('forward_op')}"
        lines.append(f"  culprit  {c['op']} ({how}) produced {_kind_text(c.get('kind'), c.get('output')).upper()}")
        src = c.get("source")
        loc = f"at {where(src)}" if src else \
            f"({_loss_source_note(d)})" if c.get("module") == "<loss>" else "(no user source line)"
        lines.append(f"  module   {module_label(c.get('module'))}   {loc}")
        if src and src.get("code"):
            lines.append(f"           {src['code']}")
    else:
        lines.append(f"  {b.headline}")
        for r in (d.get("nonfinite_leaves") or [])[:5]:
            lines.append(f"  {r['role']:10} {r['name']}: {r['nan']} NaN, {r['inf']} Inf")
    fail = _failure_text(d)
    if fail:
        lines.append(f"  failure  {fail}")
    if b.cause:
        lines.append(f"  cause    {b.cause}")
    if b.fix:
        code = "\n".join(dl.text for dl in b.fix.diff if dl.sign == "+") if b.fix.diff else b.fix.code
        first, *rest = code.splitlines() or [""]
        lines.append(f"  fix      [{b.fix.badge.text.lstrip('✓✗ ')}] {first}")
        lines += [f"           {ln}" for ln in rest[:3]]
        if b.fix.badge.tone != "ok" and b.fix.verification:
            lines.append(f"           ({b.fix.verification})")
    am = _anomaly_short(d)
    if am:
        lines.append(f"  anomaly  set_detect_anomaly {am}")
    if report_path:
        lines.append(f"  report   {report_path}")
    return "\n".join(lines)
