"""The capture sweep: every zoo architecture's training step recorded by NanGuard, replayed, compared with eager.

    python benchmarks/capture_sweep.py                  # all; writes benchmarks/capture_sweep.{md,json}
    python benchmarks/capture_sweep.py --archs hf:llama nn:LSTM --limit 20 --no-write

For each architecture (benchmarks/archs.py): one eager training step (loss, backward) under the guard as the
README shows, the snapshot the guard would write for it (`NanGuard.to_dict`, saved and loaded back through
`nanreplay.formats` exactly as `nanreplay analyze` does, no model code), its step program replayed, and the
loss and every parameter gradient compared with eager: bitwise, else within float tolerance. Prints
`architectures recorded N/M` (M: those that build and train a step on CPU here) and, for each that is not
recorded or does not replay equal, the op or the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import archs as zoo_archs  # noqa: E402

from nanreplay import NanGuard, formats  # noqa: E402
from nanreplay.replay.subject import call_model, compute_loss  # noqa: E402

HERE = Path(__file__).resolve().parent
RTOL, ATOL = 1e-4, 1e-6  # "within float tolerance": relative to each gradient's largest entry
ARCH_SECONDS = 60  # an architecture that takes longer to build, train and record is skipped as too slow


@dataclass
class Row:
    name: str
    family: str
    head: str
    status: str  # recorded | not_recorded | replay_differs | skipped
    reason: str = ""
    op: str = ""  # the op off the allowlist, where that is the reason
    params: int = 0
    nodes: int = 0
    bitwise: bool | None = None
    max_diff: float | None = None  # the largest |replay - eager| / (max |eager| + ATOL) over loss and gradients
    seconds: float = 0.0


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def eager_step(built, inputs, target):
    """The eager training step on this batch: (loss, {param name: grad})."""
    model = built.model
    model.zero_grad(set_to_none=True)
    loss = compute_loss(call_model(model, inputs), target, built.loss_fn)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def replay_snapshot(path: str):
    """Load a snapshot as `nanreplay analyze` does (no code from it) and run its step: (loss, {name: grad})."""
    snap = formats.load(path)
    subject = formats.rebuild(snap, model=None, loss=None, device="cpu", trust=False)
    subject.prepare()
    loss = subject.loss(subject.forward())
    loss.backward()
    model = subject.model
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    aliases = getattr(model, "aliases", {}) or {}
    return loss.detach(), grads, aliases, subject


def compare(eager_loss, eager_grads, loss, grads, aliases) -> tuple[bool, float, str]:
    """(bitwise, worst relative difference, what differs) of a replay against eager."""
    pairs = [("loss", eager_loss, loss)]
    for name, g in eager_grads.items():
        pairs.append((name, g, grads.get(aliases.get(name, name))))
    bitwise, worst, what = True, 0.0, ""
    for name, a, b in pairs:
        if b is None:
            if bool((a == 0).all()):
                continue
            return False, float("inf"), f"no gradient for {name} in the replay"
        if a.shape != b.shape:
            return False, float("inf"), f"{name}: shape {list(b.shape)} in the replay, {list(a.shape)} in eager"
        a64, b64 = a.double(), b.double()
        same = torch.equal(a64.nan_to_num(), b64.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
        bitwise &= same
        if not same:
            scale = float(a64.abs().max()) + ATOL
            d = float((a64 - b64).abs().max()) / scale
            if d > worst:
                worst, what = d, name
    return bitwise, worst, what


def sweep_one(arch, folder: str) -> Row:
    row = Row(arch.name, arch.family, arch.head, "skipped")
    t0 = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)  # put back after: a caller's own handler (pytest's)
    signal.alarm(ARCH_SECONDS)
    try:
        try:
            built = arch.make()
        except zoo_archs.Skipped as e:
            row.reason = f"not built: {e}"
            return row
        except Exception as e:  # noqa: BLE001 - the world's code: record why, go on
            row.reason = f"not built: {type(e).__name__}: {_line(e)}"
            return row
        row.params = sum(p.numel() for p in built.model.parameters())
        opt = torch.optim.SGD(built.model.parameters(), lr=1e-3)
        guard = NanGuard(built.model, opt, loss_fn=built.loss_fn, folder=folder)
        try:
            # A warm-up step first: a failure is never a model's very first forward, and some models change
            # their own state then (big_bird switches its attention type on the first short sequence).
            eager_step(built, *built.batch(0))
            inputs, target = built.batch(1)
            guard.begin(inputs, target, step=1)
            eager_loss, eager_grads = eager_step(built, inputs, target)
        except Exception as e:  # noqa: BLE001
            row.reason = f"does not train a step: {type(e).__name__}: {_line(e)}"
            guard.close()
            return row
        if not torch.isfinite(eager_loss):
            row.reason = "the tiny model's loss is not finite"
            guard.close()
            return row
        try:
            d = guard.to_dict("loss")
        except Exception as e:  # noqa: BLE001 - in a loop the guard says this in its one warning
            guard.close()
            row.status, row.reason = "not_recorded", f"the snapshot cannot be written: {_line(e)}"
            return row
        guard.close()
        if "_Timeout" in str(d.get("program_error")):  # the alarm went off while the guard was recording
            raise _Timeout()
        if d["step_program"] is None:
            row.status, row.reason = "not_recorded", str(d.get("program_error"))
            m = re.search(r"uses (aten\.[\w.]+)", row.reason)
            row.op = m.group(1) if m else ""
            return row
        row.nodes = len(json.loads(d["step_program"])["nodes"])
        path = os.path.join(folder, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', arch.name)}.pt")
        torch.save(d, path)
        try:
            loss, grads, aliases, _ = replay_snapshot(path)
        except Exception as e:  # noqa: BLE001
            row.status, row.reason = "replay_differs", f"replay failed: {type(e).__name__}: {_line(e)}"
            return row
        finally:
            os.unlink(path)
        bitwise, worst, what = compare(eager_loss, eager_grads, loss, grads, aliases)
        row.bitwise, row.max_diff = bitwise, worst
        if worst <= RTOL:
            row.status = "recorded"
            if not bitwise:
                row.reason = f"within tolerance (largest relative difference {worst:.1e}, {what})"
        else:
            row.status, row.reason = "replay_differs", f"{what}: relative difference {worst:.1e}"
        return row
    except _Timeout:
        row.status, row.reason = "skipped", f"took longer than {ARCH_SECONDS}s on CPU"
        return row
    except Exception as e:  # noqa: BLE001
        row.status, row.reason = "skipped", f"{type(e).__name__}: {_line(e)}"
        return row
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        row.seconds = round(time.perf_counter() - t0, 2)


def _line(e: BaseException, n: int = 200) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else "")[:n]


LIBRARIES = (("hf:", "transformers"), ("diffusers:", "diffusers"), ("pyg", "torch_geometric"), ("timm:", "timm"),
             ("torchaudio:", "torchaudio"), ("ops:", "torch (issue 36 op families)"))


def library(name: str) -> str:
    """Which library's code an architecture is: transformers, diffusers, torch_geometric, timm, torchaudio, torch.nn."""
    return next((lib for prefix, lib in LIBRARIES if name.startswith(prefix)), "torch.nn")


def summary(rows: list[Row]) -> dict:
    trained = [r for r in rows if r.status != "skipped"]
    ok = [r for r in trained if r.status == "recorded"]
    return {"recorded": len(ok), "trainable": len(trained), "total": len(rows),
            "bitwise": sum(1 for r in ok if r.bitwise), "percent": round(100 * len(ok) / max(1, len(trained)), 1)}


def by_library(rows: list[Row]) -> dict[str, dict]:
    libs: dict[str, list[Row]] = {}
    for r in rows:
        libs.setdefault(library(r.name), []).append(r)
    return {lib: summary(rs) for lib, rs in libs.items()}


def versions() -> dict:
    v = {"torch": torch.__version__, "python": sys.version.split()[0], "cpu": torch.backends.cpu.get_cpu_capability()}
    for mod in ("transformers", "diffusers", "torch_geometric", "timm", "torchaudio"):
        try:
            v[mod] = __import__(mod).__version__
        except ImportError:
            v[mod] = None
    return v


def _versions_line(v: dict) -> str:
    libs = ", ".join(f"{k} {v[k]}" for k in ("transformers", "diffusers", "torch_geometric", "timm", "torchaudio")
                     if v.get(k))
    return f"torch {v['torch']}, {libs}, python {v['python']}, ATen CPU path {v.get('cpu') or 'not recorded'}"


def markdown(rows: list[Row], s: dict, v: dict, runs: list[tuple[dict, list[str]]] | None = None) -> str:
    """The note: overall and per-library figures, every architecture not recorded and why, the rest listed."""
    runs = runs or [(v, sorted({library(r.name) for r in rows}))]
    out = ["# Capture sweep", "", "`python benchmarks/capture_sweep.py` (`--archs pyg timm: ...` for a part; "
           "`--combine A.json B.json` merges runs made in different environments into this note). Runs:", ""]
    out += [f"* {_versions_line(rv)}: {', '.join(libs)}" for rv, libs in runs]
    out += ["", "\"bitwise\" compares the replay with eager in one process, on the machine and math-library path of its run."]
    out += ["", f"**architectures recorded {s['recorded']}/{s['trainable']}** ({s['percent']}%; {s['bitwise']} bitwise "
            f"equal to eager, the rest within relative {RTOL:g}); {s['total'] - s['trainable']} of {s['total']} "
            "did not build or train a step on CPU from a tiny config (listed at the end).", "",
            "| library | recorded | of those that build and train | % | bitwise | not built/trained |",
            "|---|---|---|---|---|---|"]
    for lib, ls in by_library(rows).items():
        out.append(f"| {lib} | {ls['recorded']} | {ls['trainable']} | {ls['percent']} | {ls['bitwise']} | "
                   f"{ls['total'] - ls['trainable']} |")
    out.append("")
    bad = [r for r in rows if r.status in ("not_recorded", "replay_differs")]
    if bad:
        out += ["## Not recorded or not equal to eager", "", "| architecture | family | status | op / reason |",
                "|---|---|---|---|"]
        out += [f"| {r.name} | {r.family} | {r.status} | {_md(r.op or r.reason)} |" for r in bad]
        out.append("")
    out += ["## Recorded", "", "| architecture | family | head | params | ops | replay | seconds |",
            "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.status == "recorded":
            eq = "bitwise" if r.bitwise else f"≤ {r.max_diff:.0e}"
            out.append(f"| {r.name} | {r.family} | {r.head} | {r.params} | {r.nodes} | {eq} | {r.seconds} |")
    skipped = [r for r in rows if r.status == "skipped"]
    if skipped:
        out += ["", "## Not built or not trained (not counted)", "", "| architecture | reason |", "|---|---|"]
        out += [f"| {r.name} | {_md(r.reason)} |" for r in skipped]
    return "\n".join(out) + "\n"


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")[:220]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="*", help="only architectures whose name contains one of these")
    ap.add_argument("--limit", type=int, help="at most this many architectures (spread over the list)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not write capture_sweep.{md,json}")
    ap.add_argument("--out", default=str(HERE / "capture_sweep"), help="output path without extension")
    ap.add_argument("--combine", nargs="+", metavar="JSON", help="merge these runs' rows (the first run of an "
                    "architecture wins) into the note instead of sweeping")
    args = ap.parse_args(argv)
    if args.combine:
        return combine(args.combine, args.out)
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("nanreplay").setLevel(logging.ERROR)
    chosen = zoo_archs.select(zoo_archs.all_archs(), args.archs, args.limit)
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for arch in chosen:
            row = sweep_one(arch, folder)
            rows.append(row)
            tail = f"  {row.op or row.reason}" if row.status != "recorded" or row.reason else ""
            print(f"{row.status:15s} {row.name:45s} {row.seconds:6.1f}s{tail}", flush=True)
    s = summary(rows)
    v = versions()
    print()
    for lib, ls in by_library(rows).items():
        print(f"{lib}: architectures recorded {ls['recorded']}/{ls['trainable']} ({ls['percent']}%), "
              f"{ls['bitwise']} bitwise; {ls['total'] - ls['trainable']} not built/trained")
    print(f"overall: architectures recorded {s['recorded']}/{s['trainable']} ({s['percent']}%), {s['bitwise']} bitwise; "
          f"{s['total'] - s['trainable']} not built/trained; {time.perf_counter() - t0:.0f}s")
    for r in rows:
        if r.status in ("not_recorded", "replay_differs"):
            print(f"  not recorded: {r.name}: {r.op or r.reason}")
    if not args.no_write:
        doc = {"versions": v, "summary": s, "libraries": by_library(rows), "rows": [asdict(r) for r in rows]}
        Path(args.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
        Path(args.out + ".md").write_text(markdown(rows, s, v))
    return 0


def combine(paths: list[str], out: str) -> int:
    """One note from runs made in different environments (timm and torchaudio need a torch their builds load with)."""
    rows: dict[str, Row] = {}
    runs = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        new = [Row(**r) for r in d["rows"] if r["name"] not in rows]
        rows.update({r.name: r for r in new})
        if new:
            runs.append((d["versions"], sorted({library(r.name) for r in new})))
    merged = list(rows.values())
    s = summary(merged)
    Path(out + ".json").write_text(json.dumps({"versions": runs[0][0] if runs else versions(), "runs": runs,
                                               "summary": s, "libraries": by_library(merged),
                                               "rows": [asdict(r) for r in merged]}, indent=1) + "\n")
    Path(out + ".md").write_text(markdown(merged, s, runs[0][0] if runs else versions(), runs))
    for lib, ls in by_library(merged).items():
        print(f"{lib}: architectures recorded {ls['recorded']}/{ls['trainable']} ({ls['percent']}%)")
    print(f"overall: architectures recorded {s['recorded']}/{s['trainable']} ({s['percent']}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
