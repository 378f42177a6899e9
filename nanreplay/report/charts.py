"""Chart geometry for the HTML report: numbers in, coordinates out.

The report's charts are inline SVG. This module computes where every bar, line,
tick and label goes; the template writes the SVG elements. It knows nothing about
analyses — `report.views.charts` decides what is drawn, labelled and marked. Every
coordinate the SVG needs is computed here, text positions included, so the template
does no arithmetic.

Why hand-made SVG and not matplotlib's SVG backend:
* matplotlib is a heavy dependency the design card does not list, for two simple
  charts (a bar chart and two line panels);
* its SVG output is large (glyphs drawn as paths: tens of KB per chart) against the
  page's size budget, while these charts cost a few KB;
* every label here still goes through the template's autoescape (a module name
  cannot inject markup into the SVG), the output is deterministic, needs no fonts,
  images or network, and prints crisply.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

WIDTH = 900  # the widest chart's viewBox width, in CSS pixels: charts are drawn 1:1, never scaled up
NARROW = 360  # a phone's column: the narrow variant of a chart is drawn this wide
FONT = 11.0  # the charts' font size (report.css), for the layout of text
CHAR_W = 6.8  # the width of one character at FONT, with room to spare (the culprit's label is bold)


TICK_GAP = 6.0  # between a value axis and its tick labels; also the inset of labels inside the plot
BASELINE = 4.0  # a label's baseline this far below a line centres its text on it
@dataclass
class Tick:
    """A grid line across the plot at `y`, its value written left of the axis."""

    y: float
    label: str
    label_y: float


def _tick(y: float, label: str) -> Tick:
    return Tick(y, label, y + BASELINE)


@dataclass
class XTick:
    """A step written under the step axis."""

    x: float
    label: str


@dataclass
class Marker:
    """A vertical dashed line at a step, labelled at the top; labels are staggered so they do not overlap."""

    x: float
    label: str
    y1: float
    y2: float
    label_x: float
    label_y: float
    anchor: str = "end"  # text-anchor of the label: "start" near the left edge


# ------------------------------------------------------------------ log-scale bars


@dataclass
class BarItem:
    value: float  # > 0 drawn on the log axis; 0 as a stub; NaN/±Inf as a full-height "bad" bar
    label: str
    title: str
    value_text: str = ""
    near: bool = False  # close to the limit: drawn in the warning colour
    culprit: bool = False  # outlined and marked


@dataclass
class Bar:
    x: float
    y: float
    w: float
    h: float
    tone: str  # ok | near | bad (non-finite)
    culprit: bool
    label: str  # shortened for the axis; the full text is in title
    title: str
    value: str  # written above a non-finite bar ("" where the bars are too narrow for it)
    cx: float  # the bar's centre: its value and culprit mark are centred on it
    value_y: float  # baseline of the value written above a non-finite bar
    mark_y: float  # baseline of the culprit mark, above the value when there is one
    label_x: float  # where the rotated axis label is anchored


@dataclass
class HLine:
    """A limit across the plot (a dtype's largest value), labelled in the gutter right of the plot."""

    y: float
    label: str  # "float16 max"
    broken: bool  # drawn above an axis break: the limit is far beyond the data
    label_y: float
    value: str  # "65504", on the label's second line
    value_y: float
    note: str = ""  # a third line where the axis is broken
    note_y: float = 0.0


@dataclass
class BarChart:
    width: int
    height: int
    left: float
    top: float
    right: float
    bottom: float
    bars: list[Bar]
    ticks: list[Tick]
    lines: list[HLine]
    axis_break: float | None  # y of the break marker on the axis, when the axis is broken
    show_labels: bool
    tick_x: float  # right end of the tick labels
    limit_label_x: float  # start of the limit lines' labels
    label_y: float  # top of the rotated bar labels
    axis_label_y: float  # centre of the value axis's title
    break_path: str  # the break marker's SVG path; "" when the axis is not broken


BREAK_DECADES = 6  # a limit this many decades above the data is drawn above an axis break
BROKEN_NOTE = "(axis broken)"
MIN_SLOT = 14.0  # the narrowest bar slot whose rotated label does not overlap its neighbour's
MAX_SLOT = 44.0  # the widest: a chart of a few bars stays small
VALUE_SLOT = 26.0  # a non-finite bar's value ("+Inf") is written above it from this slot width on
LABEL_ANGLE = 55.0  # the bar labels' rotation, in degrees
MARK_Y = 13.0  # baseline of the culprit mark in the band above the plot ...
VALUE_Y = 28.0  # ... and of the values written above non-finite bars
BAND = 34.0  # the band above the plot that holds them: nothing else is drawn there
PLOT_H = 170.0  # the height of the plot itself


def _short(s: str, n: int = 24) -> str:
    """An axis label of at most n characters that keeps what tells calls apart: the last index in the
    module path ('layers.7'), the end of the name, and a call number ('#2')."""
    if len(s) <= n:
        return s
    m = re.fullmatch(r"(.*?)( #\d+)?", s)
    path, call = m.group(1), m.group(2) or ""
    room = n - len(call)
    tail = "…" + path[-(room - 1):]
    parts = path.split(".")
    idx = [i for i, p in enumerate(parts) if p.isdigit()]
    if not idx or ".".join(parts[idx[-1]:]) in tail:
        return tail + call
    if len(parts[idx[-1]]) + 3 < room:
        head = parts[idx[-1]] + ".…"
        rest = ".".join(parts[idx[-1] + 1:])
        return head + rest[-(room - len(head)):] + call if rest else parts[idx[-1]] + call
    return tail + call


def log_bars(items: Sequence[BarItem], limits: dict[str, float], *, max_width: float = WIDTH) -> BarChart:
    """Bars on a log10 axis, with horizontal lines at `limits` (label -> value).

    A limit far above the data (float32's 3.4e38 over activations near 1) would
    squash every bar to the floor, so the axis is broken: the data keeps the height,
    the limit is drawn in a band above the break, labelled as such. The chart is as
    wide as its bars need (at most `max_width`): a few bars make a small chart.
    Non-finite bars run up through the limit line into a band above the plot where
    their value and the culprit's mark are written, clear of every line.
    """
    finite = [it.value for it in items if math.isfinite(it.value) and it.value > 0]
    lo = math.floor(math.log10(min(finite))) - 1 if finite else -1
    data_hi = math.ceil(math.log10(max(finite))) + 1 if finite else 1
    lim_hi = math.ceil(math.log10(max(limits.values()))) if limits else data_hi
    broken = lim_hi - data_hi > BREAK_DECADES
    hi = max(data_hi if broken else max(data_hi, lim_hi), lo + 2)
    left = 58.0
    labels = [_short(it.label) for it in items]
    values = {k: f"{m:.5g}" for k, m in limits.items()}
    gutter = max([len(k) for k in limits] + [len(v) for v in values.values()] +
                 ([len(BROKEN_NOTE)] if broken else []), default=0) * CHAR_W + 2 * TICK_GAP

    def slot_for(left: float) -> float:
        return max(1.0, min(MAX_SLOT, (max_width - left - gutter) / max(1, len(items))))

    slot = slot_for(left)
    show_labels = slot >= MIN_SLOT
    longest = max((len(t) for t in labels), default=0) if show_labels else 0
    if show_labels and labels:  # the first label runs down-left from its bar: leave it room
        angle = math.radians(LABEL_ANGLE)  # the rotated box: its length across, plus its height's share
        reach = len(labels[0]) * CHAR_W * math.cos(angle) + FONT * math.sin(angle)
        left = max(left, round(reach - slot / 2 + 6.0, 1))
        slot = slot_for(left)
    label_band = longest * CHAR_W * math.sin(math.radians(LABEL_ANGLE)) + FONT + 10.0 if show_labels else 10.0
    right = round(left + slot * max(1, len(items)), 1)
    width = int(math.ceil(right + gutter))
    line_y = BAND + 8.0  # a broken axis: the limit line, just under the band
    top = line_y + 22.0 if broken else BAND + 6.0
    bottom = top + PLOT_H
    height = int(math.ceil(bottom + label_band))

    def y_of(v: float) -> float:
        return bottom - (math.log10(v) - lo) / (hi - lo) * (bottom - top)

    bw = max(1.0, min(28.0, slot * 0.7))
    bars = []
    for i, it in enumerate(items):
        x = left + i * slot + (slot - bw) / 2
        if not math.isfinite(it.value):
            y, tone = BAND, "bad"  # up through the limit line: it overflowed (or holds NaN)
        elif it.value <= 0:
            y, tone = bottom - 2, "ok"
        else:
            y, tone = y_of(max(it.value, 10.0 ** lo)), ("near" if it.near else "ok")
        bx, by, w = round(x, 1), round(y, 1), round(bw, 1)
        cx = round(bx + w / 2, 1)
        value = it.value_text if tone == "bad" and slot >= VALUE_SLOT else ""
        mark_y = MARK_Y if tone == "bad" else round(max(MARK_Y, by - 4), 1)
        bars.append(Bar(bx, by, w, round(max(bottom - y, 1.0), 1), tone, it.culprit, labels[i], it.title,
                        value, cx=cx, value_y=VALUE_Y, mark_y=mark_y, label_x=round(cx + 3, 1)))
    lines = []
    for label, m in limits.items():
        far = broken and math.log10(m) > hi
        ly = line_y if far else round(y_of(m), 1)
        lines.append(HLine(ly, label, far, ly + BASELINE, values[label], ly + BASELINE + FONT + 2,
                           BROKEN_NOTE if far else "", ly + BASELINE + 2 * (FONT + 2)))
    step = max(1, math.ceil((hi - lo) / 8))
    ticks = [_tick(round(y_of(10.0 ** k), 1), f"1e{k}") for k in range(lo, hi + 1) if (k - lo) % step == 0]
    tick_x = left - TICK_GAP
    axis_break = (top - 10.0) if broken else None
    break_path = (f"M{tick_x} {axis_break + 3} l6 -6 M{tick_x} {axis_break + 8} l6 -6"
                  if axis_break is not None else "")
    return BarChart(width, height, left, top, right, bottom, bars, ticks, lines, axis_break, show_labels,
                    tick_x=tick_x, limit_label_x=right + TICK_GAP, label_y=bottom + 6, axis_label_y=(top + bottom) / 2,
                    break_path=break_path)


# ------------------------------------------------------------------ lines over steps


@dataclass
class Polyline:
    points: str  # "x,y x,y ..."


@dataclass
class Dot:
    x: float
    y: float
    title: str
    bad: bool  # a non-finite value: drawn at the panel's top edge
    r: float  # radius: a non-finite value's dot is larger
    label: str = ""  # written beside the first dot of a run of non-finite values: what it is
    label_x: float = 0.0
    label_y: float = 0.0
    anchor: str = "start"


@dataclass
class Panel:
    name: str
    top: float
    bottom: float
    scale: str  # log | linear
    ticks: list[Tick]
    lines: list[Polyline]
    dots: list[Dot]
    name_y: float  # baseline of the panel's name, inside its top left corner


@dataclass
class LineChart:
    width: int
    height: int
    left: float
    right: float
    panels: list[Panel]
    xticks: list[XTick]
    markers: list[Marker]
    tick_x: float  # right end of the value-axis tick labels
    name_x: float  # start of the panels' names
    xtick_y: float  # baseline of the step labels


def nice_ticks(lo: float, hi: float, n: int = 4, *, integer: bool = False) -> list[float]:
    """About n round tick values (1, 2, 2.5, 5 × 10^k steps) covering [lo, hi]; whole numbers only if `integer`."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    mults = (1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)
    step = min((m * mag for m in mults if m * mag >= raw), default=raw)
    if integer:
        step = max(1.0, float(round(step)))
    out, v = [], math.ceil(lo / step) * step
    while v <= hi + step * 1e-9 and len(out) < 12:
        out.append(0.0 if abs(v) < step * 1e-9 else v)
        v += step
    return out


def _scale(vals: list[float], top: float, bottom: float, fmt: Callable[..., str]):
    """(y_of, ticks, name): log10 when every value is positive and they span over two decades."""
    pos = [v for v in vals if v > 0]
    if vals and len(pos) == len(vals) and max(pos) / min(pos) > 100:
        lo, hi = math.floor(math.log10(min(pos))), math.ceil(math.log10(max(pos)))
        hi = max(hi, lo + 1)

        def y_log(v: float) -> float:
            return bottom - (math.log10(v) - lo) / (hi - lo) * (bottom - top)

        every = max(1, math.ceil((hi - lo) / 4))
        return y_log, [_tick(round(y_log(10.0 ** k), 1), f"1e{k}") for k in range(lo, hi + 1) if (k - lo) % every == 0], "log"
    a, b = (min(vals), max(vals)) if vals else (0.0, 1.0)
    if a == b:
        a, b = a - 1, b + 1
    pad = (b - a) * 0.08
    a, b = a - pad, b + pad

    def y_lin(v: float) -> float:
        return bottom - (v - a) / (b - a) * (bottom - top)

    return y_lin, [_tick(round(y_lin(t), 1), fmt(t, 3)) for t in nice_ticks(a, b)], "linear"


def step_lines(steps: Sequence[float], series: Sequence[tuple[str, Sequence[float | None]]],
               marks: Sequence[tuple[float, str]], fmt: Callable[..., str], *, width: float = WIDTH) -> LineChart:
    """One panel per series over a shared step axis; non-finite values break the line and show as red dots.

    The first dot of each run of non-finite values is labelled with its value, so the chart
    says what the red dots are without hovering. Steps that are whole numbers get whole-number
    ticks.
    """
    width = int(width)
    left, right = 64.0, width - 16.0
    panel_h, gap, top0 = 120.0, 34.0, 14.0 + 13.0 * len(marks)  # room for the marker labels on top
    x0, x1 = float(min(steps)), float(max(steps))
    span = (x1 - x0) or 1.0

    def x_of(s: float) -> float:
        return round(left + (s - x0) / span * (right - left), 1)

    panels = []
    for n, (name, vals) in enumerate(series):
        top = top0 + n * (panel_h + gap)
        bottom = top + panel_h
        y_of, ticks, scale = _scale([v for v in vals if v is not None and math.isfinite(v)], top, bottom, fmt)
        lines, cur, dots = [], [], []
        prev_bad = False
        for s, v in zip(steps, vals, strict=True):
            if v is None or not math.isfinite(v):
                if len(cur) > 1:
                    lines.append(Polyline(" ".join(cur)))
                cur = []
                if v is not None:
                    x = x_of(s)
                    dot = Dot(x, top, f"step {fmt(s)}: {name} {fmt(v)}", True, 4)
                    if not prev_bad:  # the first of a run: say what it is, inside the plot
                        at_right = x > left + (right - left) * 0.6
                        dot.label = f"{fmt(v)} at step {fmt(s)}"
                        dot.label_x, dot.label_y = (x - 7 if at_right else x + 7), top + 15
                        dot.anchor = "end" if at_right else "start"
                    dots.append(dot)
                prev_bad = v is not None
                continue
            prev_bad = False
            y = round(y_of(v), 1)
            cur.append(f"{x_of(s)},{y}")
            if len(steps) <= 60 or len(cur) == 1:
                dots.append(Dot(x_of(s), y, f"step {fmt(s)}: {name} {fmt(v)}", False, 2.2))
        if len(cur) > 1:
            lines.append(Polyline(" ".join(cur)))
        panels.append(Panel(name, top, bottom, scale, ticks, lines, dots, name_y=top + 12))
    height = int(top0 + len(series) * (panel_h + gap) + 6)
    integer = all(float(s).is_integer() for s in steps)
    n_ticks = max(2, min(6, int((right - left) // 70)))
    xticks = [XTick(x_of(t), fmt(int(t) if float(t).is_integer() else t))
              for t in nice_ticks(x0, x1, n_ticks, integer=integer) if x0 <= t <= x1]
    markers = []
    for i, (x, label) in enumerate((x_of(s), label) for s, label in marks if x0 <= s <= x1):
        at_left = x - left < len(label) * CHAR_W  # a label that would run off the left edge goes right of its line
        markers.append(Marker(x, label, y1=4 + 13 * i, y2=height - 20, label_x=x + 4 if at_left else x - 4,
                              label_y=13 + 13 * i, anchor="start" if at_left else "end"))
    return LineChart(width, height, left, right, panels, xticks, markers, tick_x=left - TICK_GAP,
                     name_x=left + TICK_GAP, xtick_y=height - 8)
