"""The machine section: the guard's in-process re-run beside the training step (differential/machine.py).

`machine_view()` builds the section from the analysis JSON (no I/O): one line (`line`) that the banner, the terminal
summary and the Markdown summary show when the verdict decides the diagnosis (`first_screen`: transient, or a
finite replay the re-run contradicts or cannot settle), and the table of what ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanreplay.numbers import num

LABELS = {"transient": "transient (the machine)", "reproducible": "reproducible (the step)",
          "inconclusive": "inconclusive", "skipped": "not checked"}
TONES = {"transient": "bad", "reproducible": "ok", "inconclusive": "muted", "skipped": "muted"}


@dataclass
class MachineRow:
    what: str
    where: str
    loss: str
    grads: str
    bits: str  # the loss hash / gradient hash, shortened


@dataclass
class MachineView:
    verdict: str
    label: str
    tone: str
    line: str  # "machine  transient: the same step, re-run ..." (one line, as the terminal prints it)
    sentence: str
    first_screen: bool
    declared: list[str] = field(default_factory=list)
    rows: list[MachineRow] = field(default_factory=list)


def machine_of(d: dict) -> dict | None:
    m = (d.get("differential") or {}).get("machine")
    return m if isinstance(m, dict) else None


def machine_view(d: dict) -> MachineView | None:
    m = machine_of(d)
    if m is None:
        return None
    verdict = str(m.get("verdict") or "skipped")
    sentence = str(m.get("sentence") or m.get("skipped") or "")
    finite_replay = d.get("culprit") is None
    first = verdict == "transient" or (finite_replay and verdict in ("reproducible", "inconclusive"))
    rows = [MachineRow(str(r.get("what") or ""), str(r.get("where") or "—"), _loss(r), _grads(r), _bits(r))
            for r in m.get("ran") or [] if isinstance(r, dict)]
    return MachineView(verdict=verdict, label=LABELS.get(verdict, verdict), tone=TONES.get(verdict, "muted"),
                       line=f"machine  {sentence[:1].lower()}{sentence[1:]}", sentence=sentence,
                       first_screen=first, declared=[str(x) for x in m.get("declared_nondeterminism") or []],
                       rows=rows)


def first_screen_line(d: dict) -> str | None:
    """The one line the terminal and Markdown summaries print, where the machine's verdict decides the diagnosis."""
    v = machine_view(d)
    return v.line if v is not None and v.first_screen else None


def _loss(r: dict) -> str:
    v = r.get("loss")
    return num(v) if isinstance(v, (int, float, str)) and v is not None and not isinstance(v, bool) else "—"


def _grads(r: dict) -> str:
    bad, norm = r.get("grads_nonfinite"), r.get("grad_norm")
    if bad is None:
        fin = r.get("grads_finite")
        return "—" if fin is None else ("all finite" if fin else "non-finite")
    n = f", norm {num(norm)}" if isinstance(norm, (int, float)) and not isinstance(norm, bool) else ""
    return (f"{bad} non-finite" if bad else "all finite") + n


def _bits(r: dict) -> str:
    parts = [str(r[k])[:8] for k in ("loss_hash", "grads_hash") if r.get(k)]
    return " / ".join(parts) or "—"
