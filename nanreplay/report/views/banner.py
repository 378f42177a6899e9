"""The report's top block, the verdict: what failed, where, why, and the fix (verified or not).

What the first screen shows, in order: the cause, the user's own line, what happened there
in one sentence, one sentence of why, then the fix. The rest (facts, the full explanation,
the fix's reasoning, other fixes tried) is folded. The terminal summary and the Markdown
summary are built from the same `Banner`, so the three cannot disagree.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from nanreplay.report.format import (
    Seg,
    first_sentence,
    fix_label,
    kind_of_value,
    kind_text,
    loss_name,
    module_label,
    num,
    op_base,
    segments,
    to_float,
    where,
)
from nanreplay.report.views.compiler import compiled_verdict
from nanreplay.report.views.elements import Badge, Fact


@dataclass
class DiffLine:
    sign: str  # "-" or "+"; "@" heads one edit of several (its text: file:line)
    text: str


@dataclass
class FixView:
    kind: str
    label: str  # "add an epsilon, ε = 1e-09"
    diff: list[DiffLine]  # before/after, when the fix is a change of the user's line
    code: str  # otherwise the code to add or change
    badge: Badge
    verification: str  # what the replay said, or why the fix was not replayed
    reasoning: str


@dataclass
class CodeLine:
    """The user's line the verdict is about: where it is and what it says."""

    where: str  # file:line
    function: str
    code: str
    note: str = ""  # e.g. "upstream of the culprit"


@dataclass
class Banner:
    verdict: str
    verdict_label: str
    tone: str  # bad | ok | warn
    headline: str  # what happened, in one sentence that leads with the effect, not the aten op
    subline: str  # the aten op, its autograd node: for those who want them
    cause: str
    explanation: str  # the diagnosis' explanation, without what the page says elsewhere (the precision probe)
    facts: list[Fact]
    fix: FixView | None
    other_fixes: list[FixView]
    snapshot: str
    no_fix: str = ""  # said instead of a fix when a culprit has none
    line: CodeLine | None = None
    why: list[Seg] = field(default_factory=list)  # the explanation's first sentence
    details: list[Seg] = field(default_factory=list)  # the rest of it, folded


_VERDICT_LABEL = {
    "culprit_found": "culprit found",
    "nonfinite_input": "NaN/Inf in the input batch",
    "nonfinite_parameters": "NaN/Inf already in the weights",
    "not_reproduced": "not reproduced",
}


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
    label = fix_label(kind)
    if fix.get("epsilon") is not None:
        label += f", ε = {fix['epsilon']:g}" if isinstance(fix["epsilon"], (int, float)) else f", ε = {fix['epsilon']}"
    diff: list[DiffLine] = []
    edits = [e for e in fix.get("edits") or [] if isinstance(e, dict) and e.get("before") and e.get("after")]
    if len(edits) < 2:
        edits = [fix] if fix.get("before") and fix.get("after") else []
    for e in edits:  # a fix that changes several lines: one hunk each, headed by where it goes
        if len(edits) > 1:
            diff.append(DiffLine("@", f"{e.get('file')}:{e.get('line')}"))
        diff += [DiffLine("-", ln) for ln in str(e["before"]).splitlines()]
        diff += [DiffLine("+", ln) for ln in str(e["after"]).splitlines()]
    verification = fix.get("verification") or ""
    if not verification and fix.get("verified") is None:
        verification = "not replayed: fix verification was skipped (--no-verify)"
    return FixView(kind=kind, label=label, diff=diff, code="" if diff else str(fix.get("code") or ""),
                   badge=_badge(fix), verification=verification, reasoning=fix.get("reasoning") or "")


def failure_kind(d: dict) -> str:
    """The failure's kind as the page spells it, with the sign of an Inf where the analysis knows it."""
    f = d.get("failure") or {}
    if f.get("what") == "loss" and kind_of_value(d.get("loss")):
        return kind_of_value(d.get("loss"))
    ev = next((e for e in d.get("chain") or [] if e.get("index") == f.get("event")), None)
    return kind_text(f.get("kind"), ev)


def failure_text(d: dict) -> str:
    f = d.get("failure")
    if not f:
        return ""
    kind = failure_kind(d)
    if f.get("what") == "loss":
        return f"the loss became {kind}"
    if f.get("what") == "parameter":  # an update snapshot: the weights after optimizer.step()
        return f"the weight {f.get('name')} became {kind} in the update"
    loss = d.get("loss")
    finite = to_float(loss) is not None and math.isfinite(to_float(loss))
    return f"the gradient of {f.get('name')} became {kind}" + (f" (the loss, {num(loss)}, was finite)" if finite else "")


def anomaly_short(d: dict) -> str:
    am = d.get("anomaly_mode") or {}
    if am.get("raises") is None:
        return ""
    if not am["raises"]:
        return "would stay silent"
    agree = "the culprit's own node" if am.get("agrees_with_culprit") else "a later node than the culprit"
    return f"would raise at {am.get('node')} ({agree})"


def culprit_sentence(c: dict) -> tuple[str, str]:
    """(headline, subline) for a culprit: the effect in words first, the aten op and autograd node after."""
    kind = kind_text(c.get("kind"), c.get("output"))
    if c.get("phase") == "backward" and c.get("forward_op"):
        head = f"the gradient of {op_base(c['forward_op'])} made {kind} in backward"
        sub = f"{c.get('op')} in {c.get('backward_node') or 'backward'}, the gradient of {c['forward_op']}"
    else:
        head = f"{op_base(c.get('op'))} made {kind} in {c.get('phase')}"
        call = c.get("user_call") or c.get("call")  # what the user wrote (torch.log), not the aten packet
        sub = f"{c.get('op')}" + (f", called as {call}" if call else "")
    if c.get("module") == "<loss>":
        head += ", inside the loss function"
    return head, sub


def explanation_of(d: dict) -> str:
    """The diagnosis' explanation without the precision probe's sentence: the page states that from its own table."""
    diag = d.get("diagnosis") or {}
    text = str(diag.get("explanation") or "")
    note = diag.get("precision")
    if note and note in text:
        text = text.replace(note, "").strip()
    return " ".join(text.split())


WHY_MIN = 70  # a first sentence shorter than this (once the location is gone) takes the next one along


def _without_location(text: str, d: dict) -> str:
    """The sentence without the "at file:line (module ...)" the page already shows right above it."""
    c = d.get("culprit") or {}
    src = c.get("source")
    if not src:
        return text
    at = f"{src.get('file')}:{src.get('line')}"
    mod = c.get("module")
    for suffix in (f" (module {mod!r})", " (the model's own forward)", " (module '<root>')", ""):
        text = text.replace(f" at {at}{suffix}", "").replace(f" ({at}{suffix})", "")
    # where the op ran, when that is not a module: "(in training_step(), the loss/step code …)", "(in helper(), a
    # function the model's own forward called)", "(…, inside torch)"
    return re.sub(r" \((in \w+\(\), (the loss/step code|a function the model's own forward called)[^()]*|"
                  r"the loss function[^()]*)\)", "", text)


def why_and_details(d: dict, explanation: str) -> tuple[str, str]:
    """One sentence of why (two when the first says little), and the rest of the explanation."""
    why, rest = first_sentence(explanation)
    why = _without_location(why, d)
    if len(why) < WHY_MIN and rest:
        more, rest = first_sentence(rest)
        why = f"{why} {_without_location(more, d)}"
    return why, rest


def flow_row(d: dict) -> dict | None:
    """The first parameter row of a dead-gradient analysis whose verdict is the analysis' verdict."""
    gf = d.get("gradient_flow") or {}
    return next((r for r in gf.get("per_parameter") or [] if isinstance(r, dict) and r.get("verdict") == d["verdict"]),
                None)


def banner(d: dict) -> Banner:
    verdict = d["verdict"]
    diag = d.get("diagnosis") or {}
    c = d.get("culprit")
    model_class = (d.get("model") or {}).get("class")
    facts: list[Fact] = []
    tone = "bad"
    subline = ""
    line = None
    if c:
        headline, subline = culprit_sentence(c)
        headline = headline[:1].upper() + headline[1:] if headline.startswith("the ") else headline
        facts.append(Fact("module", module_label(c.get("module"), model_class), code=True))
        src = c.get("source")
        if src:
            fn = f" in {src['function']}()" if src.get("function") else ""
            facts.append(Fact("source", f"{where(src)}{fn}", code=True))
            line = CodeLine(where(src), str(src.get("function") or ""), str(src.get("code") or "").strip())
        elif c.get("module") == "<loss>":
            facts.append(Fact("source", loss_source_note(d), tone="muted"))
        else:
            facts.append(Fact("source", "no user source line recorded", tone="muted"))
        facts.append(Fact("op", subline, code=True))
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
        headline = f"The replay is non-finite ({failure_text(d)}), but no op that made it was seen"
    else:
        tone = "ok"
        headline = "The step replayed finite: loss and every parameter gradient"
        if d.get("loss") is not None:
            subline = f"loss {num(d.get('loss'))}"
    label = _VERDICT_LABEL.get(verdict, verdict.replace("_", " "))
    spike = diag.get("spike") if isinstance(diag.get("spike"), dict) else {}
    if verdict == "not_reproduced" and spike.get("reproduced"):  # a finite spike is what the snapshot was for
        label, tone = "spike reproduced", "warn"
        headline = (f"The gradient-norm spike reproduced: norm {num(spike.get('grad_norm'))} "
                    f"(the run recorded {num(spike.get('recorded_grad_norm'))})")
    frow = flow_row(d) if verdict in ("gradient_cut", "gradient_zero") else None
    if frow is not None:
        tone, headline = "bad", str(diag.get("title") or verdict.replace("_", " "))
        headline = headline[:1].upper() + headline[1:]
        subline = str(frow.get("op") or "")
        src = frow.get("source")
        if src:
            line = CodeLine(where(src), "", str(src.get("code") or "").strip())
            facts.append(Fact("source", where(src), code=True))
        facts.append(Fact("parameters", ", ".join(map(str, (d.get("gradient_flow") or {}).get("parameters") or []))))
    compiled = compiled_verdict(d)  # the compiled replay decided it: finite eager, non-finite compiled
    if compiled:
        label, headline, tone = "reproduced compiled (finite in eager)", compiled, "bad"
        subline = f"eager loss {num(d.get('loss'))}" if d.get("loss") is not None else subline
    fail = failure_text(d)
    if fail:
        facts.append(Fact("failure", fail))
    am = anomaly_short(d)
    if am:
        facts.append(Fact("anomaly mode", f"set_detect_anomaly(True) {am}"))
    fix = fix_view(diag.get("fix") or {})
    chosen = (diag.get("fix") or {}).get("code")
    others = [fv for f in diag.get("candidates") or [] if f.get("code") != chosen and (fv := fix_view(f))]
    no_fix = "No automatic fix for this pattern: the inputs table shows what the op saw." if c and not fix else ""
    explanation = explanation_of(d)
    why, rest = why_and_details(d, explanation)
    return Banner(verdict=verdict, verdict_label=label, tone=tone,
                  headline=headline, subline=subline, cause=diag.get("title") or "",
                  explanation=explanation, facts=facts, fix=fix, other_fixes=others,
                  snapshot=d.get("snapshot") or "", no_fix=no_fix, line=line, why=segments(why),
                  details=segments(rest))


def loss_source_note(d: dict) -> str:
    """Where a culprit without a source line of the user's ran: the loss function, named as the user named it —
    `--loss X` only when they gave --loss; the loss a snapshot recorded (the guard's loss_fn) by its name alone."""
    loss, named = loss_name(d)
    what = f"--loss {loss}" if named else loss or "the loss"
    return f"inside the loss function ({what}), library code: no line of yours"
