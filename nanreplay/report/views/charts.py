"""The report's two charts as views: activation magnitudes per module call, and the training history.

What is drawn, labelled and marked is decided here; where it goes (the geometry) is
`nanreplay.report.charts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanreplay.report import charts
from nanreplay.report.format import dtype_max, module_label, module_short, num, to_float
from nanreplay.report.views.elements import Cell

MAX_BARS = 240  # activation chart: more module calls are merged into buckets
MAX_HISTORY = 2000  # training-history points drawn
SPIKE_FACTOR = 10.0  # a grad norm this many times the median of the steps before it is a spike


@dataclass
class ActivationView:
    chart: charts.BarChart
    caption: str
    notes: list[str]
    table: list[list[Cell]]  # the calls closest to their dtype's limit
    narrow: charts.BarChart | None = None  # for phones, where `chart` would shrink its text: fewer, merged bars


def call_labels(modules: list[str | None]) -> list[str]:
    """A label per module call: the module, numbered from its second call on ('encoder.0 #2')."""
    total: dict[str | None, int] = {}
    for m in modules:
        total[m] = total.get(m, 0) + 1
    seen: dict[str | None, int] = {}
    out = []
    for m in modules:
        seen[m] = seen.get(m, 0) + 1
        out.append(module_short(m) + (f" #{seen[m]}" if total[m] > 1 else ""))
    return out


def _bars(rows: list[dict], labels: list[str], cmod: str | None, model_class: str | None,
          max_bars: int) -> tuple[list[charts.BarItem], int]:
    """One bar per module call, or per bucket of consecutive calls (its largest) when there are more than `max_bars`."""
    k = max(1, math.ceil(len(rows) / max_bars))
    items: list[charts.BarItem] = []
    for i in range(0, len(rows), k):
        chunk = rows[i:i + k]
        vals = [to_float(r.get("absmax")) for r in chunk]
        j = max(range(len(chunk)), key=lambda t: math.inf if vals[t] is None or math.isnan(vals[t]) else vals[t])
        mods = [r.get("module") for r in chunk]
        culprit = cmod is not None and cmod in mods
        label = labels[i + j]
        span = (f" ({len(chunk)} calls: {module_label(mods[0], model_class)} … {module_label(mods[-1], model_class)})"
                if len(chunk) > 1 else "")
        title = f"{label}{span}: max |activation| {num(chunk[j].get('absmax'))} ({chunk[j].get('dtype')})"
        if culprit:
            title += " — the culprit's module"
        v = vals[j]
        items.append(charts.BarItem(value=v if v is not None else math.nan, label=label, title=title,
                                    value_text=num(chunk[j].get("absmax"), 3),
                                    near=any(r.get("near_overflow") for r in chunk), culprit=culprit))
    return items, k


def activation_view(d: dict) -> ActivationView | None:
    """The HF overflow debugger's data, drawn: max |activation| per module call, forward order, log scale."""
    rows = d.get("activations") or []
    if not rows:
        return None
    c = d.get("culprit") or {}
    cmod = c.get("module") if c else None
    model_class = (d.get("model") or {}).get("class")
    labels = call_labels([r.get("module") for r in rows])
    items, k = _bars(rows, labels, cmod, model_class, MAX_BARS)
    dtypes = sorted({r.get("dtype") for r in rows if r.get("dtype")})
    limits = {f"{t} max": m for t in dtypes if (m := dtype_max(t))}
    chart = charts.log_bars(items, limits)
    narrow = None
    if chart.width > charts.NARROW:  # on a phone this one would shrink: draw one for a phone's width,
        for n in range(int(charts.NARROW // charts.MIN_SLOT), 3, -1):  # with as many bars as keep their labels
            few, _ = _bars(rows, labels, cmod, model_class, n)
            narrow = charts.log_bars(few, limits, max_width=charts.NARROW)
            if narrow.show_labels:
                break
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
               + (f", {n_bad} non-finite" if n_bad else "") + ". Repeated calls of a module are numbered (#2, #3).")

    def closeness(r: dict) -> float:
        f = to_float(r.get("ratio"))
        return math.inf if f is not None and not math.isfinite(f) else (f or 0.0)

    worst = sorted(rows, key=lambda r: -closeness(r))[:12]
    table = [[Cell(module_label(r.get("module"), model_class)),
              Cell(num(r.get("absmax")), bad=bool(r.get("near_overflow"))),
              Cell(str(r.get("dtype"))), Cell(num(r.get("ratio"), 3))] for r in worst]
    return ActivationView(chart, caption, notes, table, narrow)


@dataclass
class HistoryView:
    chart: charts.LineChart | None
    caption: str
    rows: list[list[Cell]]
    spike: str
    notes: list[str]
    narrow: charts.LineChart | None = None  # the same chart drawn for a phone's width


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
    series = [("loss", loss), ("grad norm", gn)]
    chart = charts.step_lines(steps, series, marks, num) if len(hist) >= 2 else None
    narrow = charts.step_lines(steps, series, marks, num, width=charts.NARROW) if len(hist) >= 2 else None
    caption = f"loss and gradient norm over the {len(steps)} recorded steps before the snapshot."
    if any(v is not None and not math.isfinite(v) for v in loss + gn):
        caption += (" Red dots on a panel's top edge are non-finite values (NaN or ±Inf), which have no place on the "
                    "axis; the first of each run is labelled.")
    return HistoryView(chart, caption, rows, "; ".join(texts), notes, narrow)
