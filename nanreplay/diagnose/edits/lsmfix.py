"""log(softmax(x)) where the softmax is made in another function (the model's forward returns
`torch.softmax(self.net(x), -1)`, the loss takes `torch.log(probs)`): two edits of the user's lines.

The softmax call becomes `torch.log_softmax(...)` with the same arguments, so the model returns log-probabilities,
and the loss's `torch.log(probs)` becomes `probs`. Offered only where the step uses the softmax's output for
nothing but that log (and ops that read only its shape: `full_like(probs, ...)`), since every other reader would
now get log-probabilities; the reasoning says to apply `.exp()` where probabilities are needed. The replay
computes exactly the edited values at the log (log_softmax of the softmax's own input, fixes.stable_log_patch).
"""

from __future__ import annotations

from nanreplay.diagnose.edits import codefix
from nanreplay.diagnose.site import Site, packet
from nanreplay.replay import OpRecord, frame_json

ast = codefix.ast

_SHAPE_ONLY = ("aten.full_like", "aten.zeros_like", "aten.ones_like", "aten.empty_like", "aten.rand_like",
               "aten.randn_like", "aten.size", "aten.sym_size")


def _only_the_log_uses(s: Site, sm: OpRecord) -> bool:
    for i in s.consumers(s.index(sm)):
        r = s.step.ops[i]
        if r is s.rec or packet(str(r.op)) in _SHAPE_ONLY:
            continue
        if getattr(r.op, "is_view", False) and all(s.step.ops[j] is s.rec for j in s.consumers(i)):
            continue
        return False
    return True


def _to_log_softmax(text, node) -> str | None:
    """torch.softmax(a, d) / F.softmax(a, d) / a.softmax(d) -> the same call of log_softmax."""
    if not (isinstance(node, ast.Call) and codefix._callee(node) == "softmax"):
        return None
    whole, f = text(node), text(node.func)
    if not (whole.startswith(f) and f.endswith("softmax")):
        return None
    return f[:-len("softmax")] + "log_softmax" + whole[len(f):]


def edits(s: Site, sm: OpRecord) -> tuple[codefix.Rewrite | None, str]:
    """(the culprit line's rewrite, carrying the softmax line's edit in `extra`, a note for the reasoning)."""
    src, sm_src = s.source, frame_json(sm.frame)
    if not (src and sm_src and sm.call and s.call) or s.library:
        return None, ""
    if (sm_src["file"], sm_src.get("function")) == (src["file"], src.get("function")):
        return None, ""  # the same function: a one-line rewrite (or a definition above) is the fix there
    loc = codefix.locate(src, src["line"], s.spelled(s.call), ordinal=s.ordinal(s.call))
    if loc is None or not isinstance(loc.node, ast.Call) or codefix._callee(loc.node) != "log":
        return None, ""
    p = codefix.operand(loc.node, "input")
    if not isinstance(p, ast.Name) or not _only_the_log_uses(s, sm):
        return None, ""
    made = s.rewrite(_to_log_softmax, sm.call)
    if made is None:
        return None, ""
    rw = codefix.splice(src, loc, [(loc.node, p.id)], src["line"])
    rw.extra = [made]
    note = (f"; the softmax at {made.file}:{made.first or made.line} becomes log_softmax, so `{p.id}` holds "
            f"log-probabilities: apply .exp() where probabilities are needed (inference, metrics)")
    return rw, note
