"""Hand-written binary cross-entropy on a sigmoid, rewritten on the logits as edits of the user's lines.

`-(y * torch.log(p) + (1 - y) * torch.log(1 - p))` with p = sigmoid(z): each `log(p)` becomes `F.logsigmoid(z)` and
each `log(1 - p)` becomes `F.logsigmoid(-z)` — exact for any z, where p rounds to 0 or 1. What `z` is, as text,
depends on where the sigmoid is:

* on the loss's own line (`torch.log(torch.sigmoid(z))`): its argument, one edit;
* on an earlier line of the same block (`p = torch.sigmoid(h)`): `h` where it is a name; else that line becomes
  `logits = <expr>` (crossline.py), followed by `p = torch.sigmoid(logits)` where something else may read p;
* elsewhere (the model's forward returns `torch.sigmoid(self.fc(x))`, the loss gets it as `p`): that call becomes its
  argument, so the model returns the logits and `p` holds them — only where the step uses the sigmoid's output for
  nothing but these logs (the reasoning says to apply torch.sigmoid where probabilities are needed).

A sigmoid with no line of the user's (an `nn.Sigmoid()` module inside `nn.Sequential`: its line is torch's) is
edited where the Sequential was built, when the guard recorded that line (capture/construct.py, construction.py):
`nn.Sigmoid()` -> `nn.Identity()`; else the fix stays guidance. The replay computes exactly the edited code:
logsigmoid of the sigmoid's own input at each log call (fixes.stable_log_patch), at every call of the lines.
"""

from __future__ import annotations

from nanreplay.diagnose.edits import codefix, construction, crossline
from nanreplay.diagnose.site import Site, packet
from nanreplay.replay import OpRecord, frame_json

ast = codefix.ast


def _callee(n) -> str:
    return codefix._callee(n) if isinstance(n, ast.Call) else ""


def _sigmoid_arg(n):
    """z of torch.sigmoid(z) / z.sigmoid() / F.sigmoid(z), else None."""
    return codefix.operand(n, "input") if _callee(n) == "sigmoid" else None


def _complement_of(n):
    """p of `1 - p`, else None."""
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and isinstance(n.left, ast.Constant) \
            and n.left.value == 1:
        return n.right
    return None


def _only_logs_use(s: Site, sg: OpRecord, allowed: set[int]) -> bool:
    """Every op that reads the sigmoid's output (directly or through a view) is one of `allowed` (logs, `1 - p`)."""
    for i in s.consumers(s.index(sg)):
        r = s.step.ops[i]
        if id(r) in allowed:
            continue
        if getattr(r.op, "is_view", False) and all(id(s.step.ops[j]) in allowed for j in s.consumers(i)):
            continue
        return False
    return True


def edits(s: Site, sg: OpRecord, logs: list[OpRecord], complements: list[OpRecord]) -> tuple[
        codefix.Rewrite | None, str]:
    """(the culprit line's rewrite with every edit the fix needs, a note for the reasoning), or (None, "")."""
    src = s.source
    if not src or s.library or any((frame_json(r.frame) or {}).get("line") != src["line"] for r in logs):
        return None, ""  # the logs are not all on the culprit's line
    loc = codefix.locate(src, src["line"], s.spelled(s.call), ordinal=s.ordinal(s.call))
    if loc is None:
        return None, ""
    text = codefix.source_of_nodes(loc.parsed)
    stmt = codefix._statement(loc.parsed.tree, loc.node) or loc.node
    Fn = codefix.functional(src)
    defs = crossline.Definitions(src, src["line"])
    sg_src = frame_json(sg.frame)
    names: dict[str, str] = {}  # p -> the logits' text
    note = ""

    def logits_of(p) -> str | None:
        nonlocal note
        z = _sigmoid_arg(p)
        if z is not None:
            return text(z) if sg_src and sg_src["line"] == src["line"] else None
        if not isinstance(p, ast.Name):
            return None
        if p.id in names:
            return names[p.id]
        d = defs.find(p.id)
        if d is not None:
            z = _sigmoid_arg(d.value)
            if z is None or not sg_src or sg_src["line"] != d.line:
                return None
            if isinstance(z, ast.Name):
                names[p.id] = z.id
            else:
                new = defs.fresh("logits")
                defs.replace(d, [f"{new} = {d.src(z)}"] + ([f"{p.id} = torch.sigmoid({new})"] if d.reused else []))
                names[p.id] = new
            return names[p.id]
        # made elsewhere (the model's forward): that sigmoid call becomes its argument; `p` then holds the logits
        # (an nn.Sigmoid() module has no line of the user's: the statement that built its Sequential is edited)
        if not _only_logs_use(s, sg, {id(r) for r in logs + complements}):
            return None
        built = construction.replace_child(getattr(s.subject, "constructions", None), sg, "Sigmoid", "Identity")
        if built is None and (not sg_src or (sg_src["file"], sg_src["function"]) == (src["file"], src["function"])):
            return None
        rw = built or s.rewrite(lambda sub, node: sub(codefix.operand(node, "input")), sg.call)
        if rw is None:
            return None
        defs.edits.append(rw)
        what = (f"the nn.Sigmoid() module `{sg.module}` built at {rw.file}:{rw.first} is made nn.Identity()" if built
                else f"the sigmoid at {rw.file}:{rw.first or rw.line} is removed")
        note = (f"; {what}, so `{p.id}` holds the logits: apply torch.sigmoid where probabilities are needed "
                "(inference, metrics)")
        names[p.id] = p.id
        return p.id

    # the log calls of the statement that take this sigmoid's output: a statement can hold logs of another sigmoid
    # too (a GAN's log(D(x)) + log(1 - D(G(z))), two sigmoids made in the forward), which this fix leaves alone
    mine: set[int] | None = set()
    for r in logs:
        found = codefix.find_call(loc.parsed.tree, loc.parsed.rel(src["line"]), s.spelled(r.call),
                                  ordinal=s.ordinal(r.call))
        if not found:
            mine = None
            break
        mine.add(id(found[0]))
    parts = []
    for n in ast.walk(stmt):
        if _callee(n) != "log" or (mine is not None and id(n) not in mine):
            continue
        x = codefix.operand(n, "input")
        p, neg = (_complement_of(x), True) if _complement_of(x) is not None else (x, False)
        z = logits_of(p)
        if z is None:
            continue
        parts.append((n, f"{Fn}.logsigmoid({'-' + codefix.paren(z) if neg else z})"))
    if not any(n is loc.node for n, _ in parts):
        return None, ""
    rw = codefix.splice(src, loc, parts, src["line"])
    rw.extra = list(defs.edits)
    return rw, note


def is_sigmoid(rec: OpRecord | None) -> bool:
    return rec is not None and packet(str(rec.op)) == "aten.sigmoid"
