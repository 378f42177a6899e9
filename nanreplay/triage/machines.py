"""Transient failures per machine: the fleet's own snapshots naming a failing device.

Each analyzed snapshot whose guard recorded its re-run has a machine verdict (differential/machine.py) and the host,
device, rank and run that wrote it (the row's `machine_verdict`, `host`, `device`, `run`, `rank`). `build_machines`
counts, per host and device, the transient incidents among all of them — "cuda:3 on host-17: 4 of 5 transient
incidents in 3 runs" — largest first. Pure over the rows (which the confined workers' JSON made): no file, no torch.
"""

from __future__ import annotations

CHECKED = ("transient", "reproducible", "inconclusive")


def build_machines(rows: list[dict]) -> dict | None:
    """{"transient": N, "checked": M, "devices": [...], "summary": "..."}; None when no snapshot had a re-run record.

    A copy of a snapshot (`duplicate_of`) is not another incident."""
    checked = [r for r in rows if r.get("status") == "analyzed" and r.get("machine_verdict") in CHECKED
               and not r.get("duplicate_of")]
    if not checked:
        return None
    total = sum(r["machine_verdict"] == "transient" for r in checked)
    by: dict[tuple, list[dict]] = {}
    for r in checked:
        by.setdefault((r.get("host") or "unknown host", r.get("device") or "unknown device"), []).append(r)
    devices = []
    for (host, device), rs in by.items():
        tr = [r for r in rs if r["machine_verdict"] == "transient"]
        runs = sorted({str(r.get("run")) for r in tr if r.get("run")})
        devices.append({
            "host": host, "device": device, "transient": len(tr), "incidents": len(rs),
            "runs": len(runs), "run_ids": runs[:20],
            "ranks": sorted({r["rank"] for r in tr if isinstance(r.get("rank"), int)}),
            "files": [r["file"] for r in tr][:50], "reports": [r.get("report") for r in tr][:50],
            "sentence": sentence(device, host, len(tr), total, len(runs), len(rs)),
        })
    devices.sort(key=lambda m: (-m["transient"], -m["incidents"], m["host"], m["device"]))
    top = devices[0]
    summary = top["sentence"] if top["transient"] else f"no transient incident among {len(checked)} checked"
    return {"transient": total, "checked": len(checked), "devices": devices, "summary": summary}


def sentence(device: str, host: str, transient: int, total: int, runs: int, incidents: int) -> str:
    if not transient:
        return f"{device} on {host}: no transient incident ({incidents} checked)"
    there = f"; {incidents} incidents there in all" if incidents != transient else ""
    return (f"{device} on {host}: {transient} of {total} transient incident{'s' if total != 1 else ''} in {runs} "
            f"run{'s' if runs != 1 else ''}{there}")
