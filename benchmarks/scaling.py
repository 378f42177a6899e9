"""How a whole `nanreplay analyze` scales with the model, next to the plain step.

    python benchmarks/scaling.py [--rounds 1] [--png benchmarks/scaling.png]

The reference transformer (batch 8, NaN from p*log(p) deep inside) at widths d = 128, 256, 512, 1024
(4 layers) and depths 1, 2, 4, 8 layers (d = 384). Each point is a native snapshot written by NanGuard
and timed in fresh processes as in end_to_end.py: a plain process that loads it and runs one
forward+backward, and `nanreplay analyze` with every default analysis. Prints time and peak RSS for
both and their ratios, and draws them on one chart (needs matplotlib: `pip install -e '.[bench]'`).

The cost should grow linearly with the plain step: analyze = fixed costs (imports, torch._dynamo, the
report) + a multiple of the step. The script fits that line per sweep and prints its slope and R^2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.end_to_end import measure  # noqa: E402

WIDTHS = [(128, 2), (256, 4), (512, 8), (1024, 16)]  # (d, heads), 4 layers
DEPTHS = [1, 2, 4, 8]  # layers, d = 384
BATCH = 8


R2_TARGET = 0.98  # analyze's cost is a straight line in the plain step's (a fixed part + a multiple)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys on xs and its R^2. A ratio that moves between points is still linear
    growth when the points lie on a line: analyze = fixed costs + slope x the step."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx if sxx else float("nan")
    ss_res = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return slope, 1 - ss_res / ss_tot if ss_tot else float("nan")


def points() -> list[tuple[str, int, dict]]:
    out = [("width", d, {"layers": 4, "d": d, "heads": h, "nan_layer": 2}) for d, h in WIDTHS]
    out += [("depth", n, {"layers": n, "nan_layer": max(0, n - 2)}) for n in DEPTHS]
    return out


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for col, (sweep, xlabel) in enumerate((("width", "width d (4 layers)"), ("depth", "layers (d = 384)"))):
        pts = [r for r in rows if r["sweep"] == sweep]
        xs = [r["x"] for r in pts]
        for row, (key, unit) in enumerate((("time", "seconds"), ("rss", "peak RSS, MB"))):
            ax = axes[row][col]
            ax.plot(xs, [r[f"plain_{key}"] for r in pts], "o-", label="load + forward + backward")
            ax.plot(xs, [r[f"ana_{key}"] for r in pts], "s-", label="nanreplay analyze (all analyses + report)")
            for x, r in zip(xs, pts, strict=True):
                ax.annotate(f"{r[f'ana_{key}'] / r[f'plain_{key}']:.2f}x", (x, r[f"ana_{key}"]),
                            textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
            ax.margins(y=0.15)  # room above the last point for its ratio label
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel(xlabel)
            ax.set_ylabel(unit)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"nanreplay analyze vs the plain step (batch {BATCH}, seq 256, CPU)")
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--png", default=str(Path(__file__).with_name("scaling.png")))
    args = ap.parse_args()
    rows = []
    print(f"{'sweep':6s} {'x':>5s} {'plain s':>8s} {'analyze s':>10s} {'ratio':>6s} "
          f"{'plain MB':>9s} {'analyze MB':>11s} {'ratio':>6s}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (sweep, x, kw) in enumerate(points()):
            m = measure(kw, BATCH, Path(tmp) / f"p{i}", args.rounds, args.threads)
            med = lambda k, j, rows=m["rows"]: statistics.median(r[k][j] for r in rows)  # noqa: E731
            r = {"sweep": sweep, "x": x, "plain_time": med("plain", 0), "ana_time": med("ana", 0),
                 "plain_rss": med("plain", 1) / 1024, "ana_rss": med("ana", 1) / 1024}
            rows.append(r)
            print(f"{sweep:6s} {x:5d} {r['plain_time']:8.2f} {r['ana_time']:10.2f} "
                  f"{r['ana_time'] / r['plain_time']:5.2f}x {r['plain_rss']:9.0f} {r['ana_rss']:11.0f} "
                  f"{r['ana_rss'] / r['plain_rss']:5.2f}x", flush=True)
    for sweep in ("width", "depth"):
        pts = [r for r in rows if r["sweep"] == sweep]
        for key in ("time", "rss"):
            slope, r2 = fit([r[f"plain_{key}"] for r in pts], [r[f"ana_{key}"] for r in pts])
            print(f"{sweep} {key}: analyze = a + {slope:.2f} x plain (least squares, R^2 {r2:.3f}) — "
                  f"{'linear with the plain step: met' if r2 >= R2_TARGET else 'NOT linear'} "
                  f"(target R^2 >= {R2_TARGET})")
    try:
        chart(rows, Path(args.png))
        print(f"chart: {args.png}")
    except ImportError:
        print("chart: skipped (pip install matplotlib)")


if __name__ == "__main__":
    main()
