"""What the compiler's differential replay costs relative to the plain analysis (docs/trust.md, issue 31).

    python benchmarks/compiler_replay.py [--backend inductor|sequential_sums] [--repeat N]

Trains tests/compiledstep.py's model compiled (its sums overflow only in another order) until the guard writes
a snapshot, then analyzes that snapshot in this process N times each way, alternating: the plain analysis (the
compiler pass switched off) and the full one. Prints wall and CPU seconds (this process plus the C++ compiler's
processes) per run and the medians' ratio. A fresh torch.compiler.reset() before each run: every compile is cold
in dynamo; inductor's on-disk cache is a fresh folder per run (TORCHINDUCTOR_CACHE_DIR), as in a compile child.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor", choices=("inductor", "sequential_sums"))
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    import compiledstep
    import torch

    from nanreplay.analysis import analyze
    from nanreplay.differential import compiler

    backend = compiledstep.sequential_sums if args.backend == "sequential_sums" else "inductor"
    folder = tempfile.mkdtemp(prefix="nanreplay-bench-compiler-")
    snap = compiledstep.train_snapshot(folder, backend=backend)
    if snap is None:
        raise SystemExit("the compiled run stayed finite on this CPU: no snapshot to analyze")
    compiler.BACKEND = backend
    applies = compiler.applies
    rows: dict[str, list[tuple[float, float]]] = {"plain": [], "with the compiler replay": []}
    for _ in range(args.repeat):
        for label, on in (("plain", False), ("with the compiler replay", True)):
            compiler.applies = applies if on else (lambda result: False)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="nanreplay-bench-inductor-")
            torch.compiler.reset()
            w, c = time.perf_counter(), cpu()
            d = analyze(snap).to_json()
            rows[label].append((time.perf_counter() - w, cpu() - c))
            verdict = (d.get("differential") or {}).get("compiler", {}).get("verdict", "-")
            print(f"{label:26} wall {rows[label][-1][0]:7.2f} s  cpu {rows[label][-1][1]:7.2f} s  compiler: {verdict}",
                  flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in rows.items()}
    p, f = med["plain"], med["with the compiler replay"]
    print(f"median plain: wall {p[0]:.1f} s, cpu {p[1]:.1f} s; with the replay: wall {f[0]:.1f} s, cpu {f[1]:.1f} s; "
          f"ratio wall {f[0] / p[0]:.0f}x, cpu {f[1] / p[1]:.0f}x ({args.backend})")


if __name__ == "__main__":
    main()
