"""The zoo judged as users meet it: the culprit's line, the fault's own rule, the first fix applied and trained on.

    python benchmarks/zoo_applied.py                      # the stratified subset; merges into zoo_applied.{md,json}
    python benchmarks/zoo_applied.py --label before --nanreplay /tmp/nanreplay-at-main   # another checkout's tool
    python benchmarks/zoo_applied.py --kinds log_zero --archs hf:llama --no-write

The architectures and faults are the zoo's (benchmarks/archs.py, zoo_faults.py, zoo.train_faulty); only the
judging is stricter than benchmarks/zoo.py's:

1. the training loop runs in its own process from a scratch copy of the benchmark's code (the user's source),
   the guard writing its snapshot into another folder; an exception in the guarded loop is a failure;
2. the snapshot is analyzed as users run it: the `nanreplay` CLI from an empty folder, no `--source`, the
   training code not importable;
3. localised: the snapshot has the fault's trigger, the culprit's source line is the line to change (file and
   line: `# SITE:` in zoo_faults.py; for a scaled weight the model's line that calls the layer) and the cause
   is the fault's dedicated rule (`DEDICATED`), not any of a family;
4. fix right: the first suggested fix *applied* — its before → after edit made in the copy (realbugs/run.py's
   `apply_fix`) — trains every step with every loss and gradient finite, the steps before the fault giving the
   losses they gave unpatched, and (site faults) the patched line giving the unpatched line's values on the
   healthy samples (to 1e-4 of their scale in float32, one rounding step in bf16). A fix with no edit is
   "advice" and not right. A fix that makes float16 autocast bfloat16 (an edit of the line that made the autocast
   context) moves the healthy losses by bfloat16's rounding: they must agree to 2^-7 instead of 1e-4. The edit is
   applied in whichever of the user's files holds its `before` line, the culprit's file first (the optimizer's
   line is in the loop's file).

The subset: every fault kind × `PER_KIND` architectures, rotated over `ARCHS` (one per family: decoder, encoder,
encoder-decoder, MoE, state-space, vision, audio, CNN, RNN, torch.nn, diffusion, loss) and over the kind's
precisions; an architecture where the fault is not eligible passes its turn to the next.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ARCHS = ("hf:llama", "cnn:resnet", "hf:bert", "hf:vit", "hf:t5", "nn:TransformerEncoderLayer", "hf:mixtral",
         "rnn:lstm_lm", "hf:whisper", "hf:mamba", "diffusers:UNet2DModel", "hf:gpt2", "nn:GRU",
         "loss:CrossEntropyLoss")
PER_KIND = 2
DEDICATED = {  # the rule written for each fault: anything else is a miss
    "sqrt_zero": "sqrt_at_zero", "rsqrt_zero": "domain_edge", "log_zero": "log_of_zero",
    "div_zero": "division_by_zero", "pow_zero": "pow_at_zero", "acos_edge": "acos_asin_boundary",
    "negative_variance": "sqrt_cancellation", "masked_row": "softmax_all_masked", "masked_mean": "masked_mean_empty",
    "fp16_overflow": "fp16_overflow", "lr_spike": "training_diverged", "nan_sample": "nonfinite_input",
    "adam_eps_half": "optimizer_eps", "inf_schedule": "nonfinite_lr",
}


def _run_py():
    spec = importlib.util.spec_from_file_location("realbugs_run", HERE / "realbugs" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- the training process (the user's side)

def train_main(code: Path, arch_name: str, kind_name: str, precision: str, seed: int, snaps: Path, out: Path,
               original: Path | None) -> None:
    """One faulty run of the zoo's loop, from the copy of the code in `code`; its facts written to `out`."""
    sys.path.insert(0, str(code))
    import logging
    import warnings

    import torch
    warnings.filterwarnings("ignore")
    logging.getLogger("nanreplay").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    import archs
    import zoo
    import zoo_faults as zf
    arch = next(a for a in archs.all_archs() if a.name == arch_name)
    kind = zf.KINDS[kind_name]
    res = zoo.Result(arch.name, arch.family, kind.name, precision, "not_eligible")
    snaps.mkdir(exist_ok=True)
    t = zoo.train_faulty(arch, kind, precision, seed, str(snaps), res)
    d: dict = {"status": "not_eligible", "reason": res.reason, "site": res.site}
    if t is not None:
        g = t.guard
        snap = g.last_snapshot
        d.update(status="trained" if (g.last_trigger or t.raised) else "no_failure", losses=t.losses, stop=t.stop,
                 raised=t.raised, trigger=str(g.last_trigger or ""), snapshot=str(snap) if snap else None,
                 guard_error=g.last_error or "", module=t.plan.module, sample=t.plan.sample,
                 line=["zoo_faults.py", t.plan.line] if t.plan.line else
                 ([os.path.basename(t.plan.call_site[0]), t.plan.call_site[1]] if t.plan.call_site else None))
        if original is not None and kind.how == "site":
            d["healthy"] = _healthy_site(zf, original, kind.name, precision)
    out.write_text(json.dumps(d))


def _healthy_site(zf, original: Path, kind: str, precision: str) -> dict:
    """The patched site line against the original on the samples the fault leaves healthy (all but sample 0)."""
    import torch
    spec = importlib.util.spec_from_file_location("zoo_faults_original", original)
    orig = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = orig  # its dataclasses look their module up
    spec.loader.exec_module(orig)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    try:
        new = zf.site(kind, zf.edge(kind, x, 0), 0)[1:].float()
    except Exception as e:  # noqa: BLE001 - the patched line does not run
        return {"same": False, "error": f"{type(e).__name__}: {e}"[:200]}
    old = orig.site(kind, orig.edge(kind, x, 0), 0)[1:].float()
    tol = 1e-4 if dtype == torch.float32 else 2.0 ** -7
    scale = old.abs().amax(dim=tuple(range(1, old.dim())), keepdim=True).clamp_min(1.0)
    moved = float(((new - old).abs() / scale).max())
    return {"same": bool(torch.isfinite(new).all()) and moved <= tol, "moved": moved}


# ---------------------------------------------------------------- the judge

class Judge:
    def __init__(self, nanreplay: Path, seed: int):
        self.nanreplay, self.seed = nanreplay, seed
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env["PYTHONPATH"] = str(nanreplay)  # the tool only: the training code is not on it
        self.apply_fix = _run_py().apply_fix

    def train(self, code: Path, arch: str, kind: str, prec: str, snaps: Path, out: Path,
              original: Path | None = None) -> dict:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--train", str(code), arch, kind, prec,
               str(self.seed), str(snaps), str(out)] + ([str(original)] if original else [])
        p = subprocess.run(cmd, cwd=code, env=self.env, capture_output=True, text=True, timeout=900)
        if p.returncode or not out.exists():
            return {"status": "raised", "raised": ((p.stderr or p.stdout).strip().splitlines() or ["?"])[-1][:200]}
        return json.loads(out.read_text())

    def run(self, arch: str, kind: str, prec: str) -> dict:
        import zoo_faults as zf
        row: dict = {"arch": arch, "kind": kind, "precision": prec}
        tmp = Path(tempfile.mkdtemp(prefix=f"zoo-applied-{kind}-"))
        try:
            code, empty, orig = tmp / "code", tmp / "elsewhere", tmp / "original"
            for d in (code, empty, orig):
                d.mkdir()
            for f in HERE.glob("*.py"):  # the user's source: the zoo's loop, architectures and faulty lines
                shutil.copy(f, code / f.name)
            shutil.copy(HERE / "zoo_faults.py", orig / "zoo_faults.py")
            t0 = time.time()
            tr = self.train(code, arch, kind, prec, tmp / "snaps", tmp / "train.json")
            row.update(status=tr["status"], reason=tr.get("reason") or tr.get("raised") or "", site=tr.get("site"),
                       trigger=tr.get("trigger"))
            if tr["status"] in ("not_eligible", "no_failure"):
                return row
            row["localised"], row["fix"] = False, "no fix"
            if tr["status"] == "raised" or tr.get("raised"):
                row["fix"] = row["status"] = "guarded loop raised"
                return row
            if not tr.get("snapshot"):
                row["fix"] = row["status"] = f"no snapshot ({tr.get('guard_error', '')[:120]})"
                return row
            cli = Path(sys.executable).with_name("nanreplay")
            p = subprocess.run([str(cli), "analyze", tr["snapshot"], "--json", str(tmp / "a.json"),
                                "-o", str(tmp / "r.html")], cwd=empty, env=self.env, capture_output=True, text=True,
                               timeout=900)
            row["analyze_seconds"] = round(time.time() - t0, 1)
            if not (tmp / "a.json").exists():
                row["fix"] = row["status"] = "analysis failed"
                row["reason"] = ((p.stderr or p.stdout).strip().splitlines() or ["?"])[-1][:200]
                return row
            a = json.loads((tmp / "a.json").read_text())
            self._localised(row, a, tr, zf.KINDS[kind])
            self._fix(row, a, tr, code, orig, tmp, arch, kind, prec)
            return row
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _localised(self, row: dict, a: dict, tr: dict, kind) -> None:
        c = a.get("culprit") or {}
        src = c.get("source") or {}
        diag = a.get("diagnosis") or {}
        row.update(verdict=a.get("verdict"), op=c.get("forward_op") or c.get("op"), module=c.get("module"),
                   line=f"{Path(str(src.get('file') or '')).name}:{src.get('line')}" if src else "",
                   cause=diag.get("cause"))
        checks = {"trigger": tr.get("trigger") in kind.triggers}
        if kind.how == "data":
            leaves = a.get("nonfinite_leaves") or []
            checks["cause"] = a.get("verdict") == "nonfinite_input"
            checks["sample"] = any(tr.get("sample") in (r.get("samples") or []) for r in leaves)
        else:
            checks["cause"] = row["cause"] == DEDICATED[kind.name]
        if tr.get("line"):
            checks["line"] = row["line"] == f"{tr['line'][0]}:{tr['line'][1]}"
            row["truth_line"] = f"{tr['line'][0]}:{tr['line'][1]}"
        row["checks"] = checks
        row["localised"] = all(checks.values())
        if kind.how == "weight":
            row["truth_module"] = tr.get("module")
        rejudge(row)

    def _fix(self, row, a, tr, code, orig, tmp, arch, kind, prec) -> None:
        fix = (a.get("diagnosis") or {}).get("fix") or {}
        row.update(fix_kind=fix.get("kind"), verified=fix.get("verified"))
        if not (fix.get("before") and fix.get("after")):
            row["fix"] = "advice"
            return
        row["edit"] = f"{fix['before'].strip()[:120]} -> {fix['after'].strip()[:120]}"
        culprit_file = Path(str(((a.get("culprit") or {}).get("source") or {}).get("file") or "")).name
        files = sorted(code.glob("*.py"), key=lambda f: f.name != culprit_file)
        if not any(self.apply_fix(f, fix["before"], fix["after"]) for f in files):
            row["fix"] = "before-line not found in the user's code"
            return
        fixed = self.train(code, arch, kind, prec, tmp / "snaps2", tmp / "train2.json", orig / "zoo_faults.py")
        if fixed.get("status") == "raised" or fixed.get("raised"):
            row["fix"] = f"patched loop raised: {fixed.get('raised', '')[:120]}"
            return
        n = len(tr.get("losses") or [])
        healthy = range(min(n, len(fixed.get("losses") or []), 2))  # zoo.FAULT_STEP: the steps before the fault
        # a fix that changes the autocast dtype moves every value by up to that dtype's rounding (bfloat16: 2^-7)
        tol = 2.0 ** -7 if (fix.get("settings") or {}).get("autocast_dtype") == "bfloat16" else 1e-4
        same = all(abs(fixed["losses"][i] - tr["losses"][i]) <= tol * max(1.0, abs(tr["losses"][i]))
                   for i in healthy)
        h = fixed.get("healthy")
        if h is not None:
            row["healthy_moved"] = h.get("moved")
            same = same and h["same"]
        trained = fixed.get("stop") is None and not fixed.get("trigger")
        row["fix"] = "right" if (trained and same) else \
            ("healthy values changed" if trained else f"still breaks ({fixed.get('stop') or fixed.get('trigger')})")


LOOP_FILES = ("subject.py", "zoo.py")  # the loop's own `model(x)` (nanreplay.replay.subject.call_model in zoo.py)


def rejudge(row: dict) -> None:
    """A scaled weight in a layer the loop calls directly (a torch.nn stack: every frame in between is torch's) has
    no line of model code to show: there the culprit's module must be the faulty layer instead of a line."""
    if row.get("checks") and (row.get("truth_line") or "").split(":")[0] in LOOP_FILES:
        row["checks"].pop("line", None)
        truth = row.get("truth_module") or str(row.get("site") or "").split(".weight")[0]
        row["checks"]["module"] = row.get("module") == truth
        row["localised"] = all(row["checks"].values())


# ---------------------------------------------------------------- the subset and the tables

def subset(kinds: list[str], archs: tuple[str, ...], per_kind: int) -> list[tuple[str, list[str], str]]:
    """(kind, architectures in the order to try, precision) for each run: the kinds over the architectures in
    rotation, each kind's runs over its precisions in turn."""
    import zoo_faults as zf
    out = []
    for kind in kinds:
        precs = zf.KINDS[kind].precisions
        for j in range(per_kind):
            turn = list(zf.KINDS).index(kind) * per_kind + j  # the same pairs whichever kinds are run
            order = [archs[(turn + i) % len(archs)] for i in range(len(archs))]
            out.append((kind, order, precs[j % len(precs)]))
    return out


def summary(rows: list[dict]) -> dict:
    counted = [r for r in rows if r.get("status") not in ("not_eligible", "no_failure")]
    n = len(counted)
    loc = sum(bool(r.get("localised")) for r in counted)
    right = sum(r.get("fix") == "right" for r in counted)
    return {"runs": n, "localised": loc, "fix_right": right,
            "localised_percent": round(100 * loc / max(n, 1), 1), "fix_right_percent": round(100 * right / max(n, 1), 1)}


def _why(r: dict) -> str:
    return (r.get("reason") or "no step went non-finite")[:70]


def markdown(d: dict) -> str:
    out = ["# Zoo, judged by applying the fix", "",
           f"`python benchmarks/zoo_applied.py` — {d.get('versions', '')}. Every fault kind × {PER_KIND} "
           "architectures (see the script's docstring for the subset and the judging).", ""]
    labels = [k for k in ("before", "after") if k in d["runs"]]
    if labels:
        out += ["| | runs | localised (line + dedicated cause) | applied fix right |", "|---|---|---|---|"]
        for k in labels:
            s = d["runs"][k]["summary"]
            out.append(f"| {k} ({d['runs'][k]['what']}) | {s['runs']} | {s['localised']}/{s['runs']} "
                       f"({s['localised_percent']}%) | {s['fix_right']}/{s['runs']} ({s['fix_right_percent']}%) |")
        out.append("")
    for k in labels:
        out += [f"## {k}", "", "| kind | arch | prec | localised | culprit line (truth) | cause | fix kind | applied |",
                "|---|---|---|---|---|---|---|---|"]
        for r in d["runs"][k]["rows"]:
            if r.get("status") in ("not_eligible", "no_failure"):
                continue
            out.append(f"| {r['kind']}{' (carried)' if r.get('carried') else ''} | {r['arch']} | {r['precision']} | "
                       f"{'yes' if r.get('localised') else 'NO'} | "
                       f"{r.get('line', '')} ({r.get('truth_line', '—')}) | {r.get('cause')} | {r.get('fix_kind')} | "
                       f"{r.get('fix')} |")
        skipped = [r for r in d["runs"][k]["rows"] if r.get("status") in ("not_eligible", "no_failure")]
        if skipped:
            out += ["", "Not counted (the fault not eligible there; the kind's turn passed to the next "
                    "architecture): " + "; ".join(f"{r['kind']} on {r['arch']} ({_why(r)})" for r in skipped)]
        out.append("")
    return "\n".join(out)


def _first(rows: list[dict], kind: str) -> int:
    return next((i for i, r in enumerate(rows) if r["kind"] == kind), len(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--kinds", nargs="*")
    ap.add_argument("--archs", nargs="*", help="the rotation of architectures (default: ARCHS)")
    ap.add_argument("--per-kind", type=int, default=PER_KIND)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nanreplay", default=str(ROOT), help="the checkout whose nanreplay guards and analyzes")
    ap.add_argument("--label", default="after", help="before | after: where the run goes in zoo_applied.json")
    ap.add_argument("--what", default="this branch", help="what the label's tool is (a commit)")
    ap.add_argument("--merge", action="store_true", help="replace only the label's rows of the kinds run now")
    ap.add_argument("--base", help="carry this label's rows for the kinds not run now (their code unchanged)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--render", action="store_true", help="only rewrite zoo_applied.md from zoo_applied.json")
    args = ap.parse_args(argv)
    if args.train:
        c, arch, kind, prec, seed, snaps, out, *orig = args.train
        train_main(Path(c), arch, kind, prec, int(seed), Path(snaps), Path(out), Path(orig[0]) if orig else None)
        return 0
    sys.path.insert(0, str(HERE))
    store = HERE / "zoo_applied.json"
    d = json.loads(store.read_text()) if store.exists() else {"runs": {}}
    for run in d["runs"].values():
        for r in run["rows"]:
            rejudge(r)
        run["summary"] = summary(run["rows"])
    if args.render:
        if args.base:  # --label L --base B --render: L = L_rerun's rows, B's for the kinds L_rerun did not run
            rerun = d["runs"].pop(f"{args.label}_rerun")
            kinds = {r["kind"] for r in rerun["rows"]}
            rows = [dict(r, carried=args.base) for r in d["runs"][args.base]["rows"] if r["kind"] not in kinds]
            rows = sorted(rows + rerun["rows"], key=lambda r: _first(d["runs"][args.base]["rows"], r["kind"]))
            d["runs"][args.label] = {"what": f"{rerun['what']}: {', '.join(sorted(kinds))} re-run, the other kinds "
                                             f"carried from {args.base}", "summary": summary(rows), "rows": rows}
        store.write_text(json.dumps(d, indent=1) + "\n")
        (HERE / "zoo_applied.md").write_text(markdown(d))
        return 0
    import zoo_faults as zf
    judge = Judge(Path(args.nanreplay).resolve(), args.seed)
    rows, t0 = [], time.time()
    for kind, order, prec in subset(args.kinds or list(zf.KINDS), tuple(args.archs or ARCHS), args.per_kind):
        for arch in order[:4]:
            r = judge.run(arch, kind, prec)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if r.get("status") not in ("not_eligible", "no_failure"):
                break
    s = summary(rows)
    print(f"\n{s} in {time.time() - t0:.0f}s")
    if not args.no_write:
        import torch
        import transformers
        d = json.loads(store.read_text()) if store.exists() else {"runs": {}}  # another label may have landed
        d["versions"] = f"torch {torch.__version__}, transformers {transformers.__version__}"
        old = d["runs"].get(args.base or args.label) if (args.merge or args.base) else None
        if old:  # re-judged kinds replace theirs; the rest of the (base) label's rows stay, marked as carried
            run_now = {r2["kind"] for r2 in rows}
            rows = [dict(r, carried=args.base or True) for r in old["rows"] if r["kind"] not in run_now] + rows
            order = list(zf.KINDS)
            rows.sort(key=lambda r: order.index(r["kind"]))
            s = summary(rows)
        d["runs"][args.label] = {"what": args.what, "summary": s, "rows": rows, "seconds": round(time.time() - t0)}
        store.write_text(json.dumps(d, indent=1) + "\n")
        (HERE / "zoo_applied.md").write_text(markdown(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
