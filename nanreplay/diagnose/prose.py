"""Sentence builders shared by the rules and the engine."""

from __future__ import annotations

import math

from nanreplay.diagnose.site import Site


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def count_in(n: int, noun: str, tensor: dict) -> str:
    """`count` out of the elements of an input summary: "63 negative values of 256" (a count alone says little)."""
    shape = tensor.get("shape")
    total = math.prod(shape) if isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape) else None
    return count(n, noun) + (f" of {total}" if total is not None else "")


def anomaly_sentence(anomaly: dict, site: Site | None) -> str:
    """What set_detect_anomaly(True) would have said, compared honestly with the culprit."""
    if anomaly.get("raises") is None:
        return ""
    if not anomaly["raises"]:
        if site is not None and site.event.kind == "inf" and not site.forward:
            return ("torch.autograd.set_detect_anomaly(True) would have stayed silent: it only checks backward "
                    "outputs for NaN, and this failure is Inf.")
        if site is not None and site.event.kind == "inf":
            return ("torch.autograd.set_detect_anomaly(True) would have stayed silent: it only checks backward "
                    "outputs for NaN, and this Inf never became a NaN in backward.")
        return ("torch.autograd.set_detect_anomaly(True) would have stayed silent: it only checks what backward "
                "nodes return, and no backward node returned NaN on this step.")
    node = anomaly["node"]
    src = anomaly.get("source") or {}
    at = f" ({anomaly['forward_op']} at {src['file']}:{src['line']})" if anomaly.get("forward_op") and src else ""
    if anomaly.get("agrees_with_culprit"):
        return f"set_detect_anomaly(True) would have raised at {node}{at}, which is this culprit's node."
    if site is None:
        return f"set_detect_anomaly(True) would have raised at {node}{at}."
    kind = "NaN" if site.event.kind == "nan" else "Inf"  # spelled as everywhere else, not upper-cased
    if site.forward:
        return (f"set_detect_anomaly(True) would have raised only in backward, at {node}{at} — a later node than the "
                f"culprit: anomaly mode checks backward outputs for NaN only, so the {kind} this forward op made "
                "went unnoticed until then.")
    step = site.step
    seq = step.anomaly.node_seq if step.anomaly is not None else None
    hit = next((e for e in step.events if e.phase == "backward" and e.node_seq == seq and e.kind == "nan"), None)
    if hit is not None and hit.index > site.event.index and hit.index in site.chain:
        why = ("the culprit made Inf, which anomaly mode does not check; it raised only where that Inf became NaN"
               if site.event.kind == "inf" else "it raised only where the NaN came out of a node")
        return f"set_detect_anomaly(True) would have raised at {node}{at} — a later node than the culprit: {why}."
    return (f"set_detect_anomaly(True) would have raised at {node}{at}, which is not on this culprit's chain: "
            "a NaN that did not cause this failure reached it first.")
