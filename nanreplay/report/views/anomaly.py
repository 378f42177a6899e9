"""Would `torch.autograd.set_detect_anomaly(True)` have caught it, and where would it have pointed?"""

from __future__ import annotations

from dataclasses import dataclass

from nanreplay.report.format import kind_text, where

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
                     f"{kind_text('inf', c.get('output'))}, and anomaly detection only checks backward outputs for "
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
