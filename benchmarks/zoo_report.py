"""The zoo's scores as tables: per fault kind, per architecture family, per precision; the misses listed."""

from __future__ import annotations


def table(results: list) -> dict:
    """Rates of every score over the runs where the fault made training non-finite (results: zoo.Result)."""
    scored = [r for r in results if r.status == "scored"]
    attempted = [r for r in results if r.status not in ("not_eligible", "no_failure")]

    def rate(rows, key):
        vals = [r.scores.get(key) for r in rows if r.scores.get(key) is not None]
        return {"n": len(vals), "ok": sum(bool(v) for v in vals),
                "percent": round(100 * sum(bool(v) for v in vals) / len(vals), 1) if vals else None}

    keys = ("snapshot", "op", "module", "line", "cause", "fix_offered", "fix_verified", "fix_plausible", "localised")

    def group(attr):
        out = {}
        for g in sorted({getattr(r, attr) for r in attempted}):
            rows = [r for r in attempted if getattr(r, attr) == g]
            sc = [r for r in rows if r.status == "scored"]
            out[g] = {"runs": len(rows), "snapshots": len(sc), **{k: rate(sc, k) for k in keys},
                      "time_ratio": _median([r.time_ratio for r in sc]),
                      "memory_ratio": _median([r.memory_ratio for r in sc])}
        return out

    loc = sum(1 for r in attempted if r.scores.get("localised"))
    fixable = [r for r in attempted if r.kind != "nan_sample"]  # a NaN in the data is cleaned, not replayed
    ver = sum(1 for r in fixable if r.scores.get("fix_verified"))
    return {"runs": len(attempted), "snapshots": len(scored), "architectures": len({r.arch for r in attempted}),
            "kinds": len({r.kind for r in attempted}),
            "localisation_percent": round(100 * loc / max(1, len(attempted)), 1),
            "verified_fix_percent": round(100 * ver / max(1, len(fixable)), 1),
            "time_ratio_median": _median([r.time_ratio for r in scored]),
            "memory_ratio_median": _median([r.memory_ratio for r in scored]),
            "by_kind": group("kind"), "by_family": group("family"), "by_precision": group("precision")}


def _median(v):
    v = sorted(x for x in v if x is not None)
    return v[len(v) // 2] if v else None


def misses(results: list) -> list:
    return [r for r in results if r.status not in ("not_eligible", "no_failure") and not r.scores.get("localised")]


def markdown(t: dict, results: list, v: dict, args_line: str) -> str:
    def pct(x):
        return "—" if x["percent"] is None else f"{x['percent']:.0f}% ({x['ok']}/{x['n']})"

    out = ["# Zoo benchmark", "", f"torch {v['torch']}, transformers {v['transformers']}, diffusers {v['diffusers']}; "
           f"`{args_line}`.", "",
           f"**localisation {t['localisation_percent']}%, verified fixes {t['verified_fix_percent']}%** over "
           f"{t['runs']} faulty runs ({t['architectures']} architectures × {t['kinds']} fault kinds); analysis "
           f"time ×{t['time_ratio_median']} and peak memory ×{t['memory_ratio_median']} (medians) of a plain load + "
           "forward + backward.", ""]
    cols = ("snapshot", "op", "module", "line", "cause", "fix_offered", "fix_verified", "fix_plausible", "localised")
    for title, key in (("By fault kind", "by_kind"), ("By architecture family", "by_family"),
                       ("By precision", "by_precision")):
        out += [f"## {title}", "", "| | runs | " + " | ".join(cols) + " | time × | memory × |",
                "|---" * (len(cols) + 4) + "|"]
        for g, row in t[key].items():
            out.append(f"| {g} | {row['runs']} | " + " | ".join(pct(row[c]) for c in cols)
                       + f" | {row['time_ratio']} | {row['memory_ratio']} |")
        out.append("")
    ms = misses(results)
    out += [f"## Misses ({len(ms)})", "", "| arch | kind | prec | site | status | trigger | verdict | culprit op | module "
            "| cause | fix | what went wrong |", "|---" * 12 + "|"]
    for r in ms:
        wrong = r.reason or ", ".join(k for k, ok in r.scores.items() if ok is False)
        out.append(f"| {r.arch} | {r.kind} | {r.precision} | {r.site} | {r.status} | {r.trigger} | {r.verdict} | "
                   f"{r.culprit_op} | {r.culprit_module} | {r.cause} | {r.fix_kind} | {_md(wrong)} |")
    nf = [r for r in results if r.status == "no_failure"]
    if nf:
        out += ["", f"## Faults that did not make training non-finite ({len(nf)}; not counted)", ""]
        out += [f"* {r.arch} × {r.kind} ({r.precision}) at {r.site}" for r in nf]
    ne = [r for r in results if r.status == "not_eligible"]
    if ne:
        out += ["", f"## Not eligible ({len(ne)})", ""] + [f"* {r.arch} × {r.kind} ({r.precision}): {_md(r.reason)}"
                                                            for r in ne]
    return "\n".join(out) + "\n"


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")[:200]
