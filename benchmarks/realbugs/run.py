"""The real-bug benchmark: training loops reproduced from public issue threads, judged by applying the fix.

    python benchmarks/realbugs/run.py                 # every case; writes benchmarks/realbugs/results.{md,json}
    python benchmarks/realbugs/run.py --cases sqrt_triangle focal_gamma --no-write

Each case (cases/<name>.py) is a small training loop written after one public issue thread (its CITE), on
the code the thread shows. For each case:

1. train it under NanGuard as the README shows, in a scratch folder (a snapshot is written when it breaks);
2. analyze the snapshot as a user would: the `nanreplay` CLI, from another, empty folder, no flags, the case's
   code not importable;
3. localised: the culprit's source line is the line the case marks `# CULPRIT` (file and line);
4. fix right: the first suggested fix, *applied* — every one of its `edits` (each `before` statement replaced
   by its `after`; a fix without `edits` is its one `before`/`after`) in a copy of the case — trains all the
   case's steps with every loss and gradient finite and the steps before the bad batch giving the losses they
   gave unpatched (to a relative 1e-4: the fix changed nothing healthy). A fix that is advice, not a line (an
   lr, a flag elsewhere), is counted as "advice"; `verified` is reported beside, never used to judge.
   An edit of the learning rate, in a case whose cause is the run's rate (EXPECT_CAUSES), changes every loss
   after the first update by design: there the first loss must be unchanged and the fixed run must learn (its
   last loss below its first). So does softplus in place of a ReLU (`positive_parametrisation`): another model,
   every loss changes; the fixed run must learn.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MARK = "# CULPRIT"


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train(case_path: Path, folder: Path, out: Path, guard_on: bool = True) -> None:
    """The README's guard loop over the case's model, batches and loss; losses and the stop written to `out`."""
    import torch

    from nanreplay import NanGuard
    case = load(case_path)
    torch.manual_seed(0)
    model, optimizer = case.build()
    loss_fn = getattr(case, "loss_fn", None)
    guard = NanGuard(model, optimizer, loss_fn=loss_fn, folder=str(folder)) if guard_on else None
    losses, stop = [], None
    takes_model = case.batch.__code__.co_argcount > 1  # a bad batch that depends on the weights (hard examples)
    for step in range(case.STEPS):
        x, y = case.batch(step, model) if takes_model else case.batch(step)
        if guard:
            guard.begin(x, y, step=step)
        optimizer.zero_grad()
        out_ = model(*x) if isinstance(x, tuple) else model(x)
        loss = loss_fn(out_, y) if loss_fn is not None else out_
        losses.append(float(loss))
        if guard and not guard.loss_ok(loss):
            stop = "loss"
            break
        if not guard and not math.isfinite(float(loss)):
            stop = "loss"
            break
        loss.backward()
        if guard and not guard.grads_ok():
            stop = "grads"
            break
        if not guard and not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None):
            stop = "grads"
            break
        optimizer.step()
    out.write_text(json.dumps({"losses": losses, "stop": stop}))


def marked_line(path: Path) -> int | None:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if MARK in line:
            return i
    return None


def apply_fix(path: Path, before: str, after: str) -> bool:
    """Replace the statement `before` (one line or several, as the report shows it: its first line's indent
    removed) by `after`, indented where the statement was."""
    lines = path.read_text().splitlines(keepends=True)
    want = [x.strip() for x in before.strip("\n").splitlines()]
    for i in range(len(lines) - len(want) + 1):
        if [x.strip() for x in lines[i:i + len(want)]] == want:
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            new = [indent + x + "\n" for x in after.strip("\n").splitlines()]
            lines[i:i + len(want)] = new
            path.write_text("".join(lines))
            return True
    return False


def run_train(case_file: Path, folder: Path, out: Path, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--train", str(case_file), str(folder), str(out)],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise CaseError(f"the training loop raised: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    return json.loads(out.read_text())


class CaseError(Exception):
    pass


def judge(name: str, keep: bool = False, cases: Path = HERE / "cases") -> dict:
    src = cases / f"{name}.py"
    case = load(src)
    row = {"case": name, "cite": case.CITE, "title": case.TITLE}
    tmp = Path(tempfile.mkdtemp(prefix=f"realbug-{name}-"))
    try:
        code, snaps, empty = tmp / "code", tmp / "snaps", tmp / "elsewhere"
        for d in (code, snaps, empty):
            d.mkdir()
        case_file = code / f"{name}.py"
        shutil.copy(src, case_file)
        t0 = time.time()
        run = run_train(case_file, snaps, tmp / "losses.json", code)
        found = sorted(snaps.glob("*.pt"))
        row["stopped"] = run["stop"]
        if not found:
            row.update(snapshot=False, localised=False, fix="no snapshot")
            return row
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(ROOT)  # this checkout's nanreplay; the case's folder is not on it
        cli = Path(sys.executable).with_name("nanreplay")
        p = subprocess.run([str(cli), "analyze", str(found[0]), "--json", str(tmp / "a.json"), "-o", str(tmp / "r.html")],
                           cwd=empty, env=env, capture_output=True, text=True, timeout=900)
        row["analyze_seconds"] = round(time.time() - t0, 1)
        if not (tmp / "a.json").exists():
            row.update(snapshot=True, localised=False, fix="analysis failed", error=(p.stderr or p.stdout)[-300:])
            return row
        a = json.loads((tmp / "a.json").read_text())
        c = a.get("culprit") or {}
        flow = (a.get("diagnosis") or {}).get("gradient_flow") or a.get("gradient_flow") or {}
        if not c and flow.get("per_parameter"):  # a dead gradient: the op that turned it into zeros (or cut it)
            c = flow["per_parameter"][0]
        srcinfo = c.get("source") or {}
        row.update(snapshot=True, verdict=a.get("verdict"), op=c.get("op"), forward_op=c.get("forward_op"),
                   file=Path(str(srcinfo.get("file") or "")).name, line=srcinfo.get("line"),
                   cause=(a.get("diagnosis") or {}).get("cause"))
        expect = getattr(case, "EXPECT_CAUSES", None)  # a run-level cause (an lr): the diagnosis names it, not a line
        row["localised"] = (row["cause"] in expect) if expect else \
            (row["file"] == f"{name}.py" and row["line"] == marked_line(case_file))
        fix = (a.get("diagnosis") or {}).get("fix") or {}
        row.update(fix_kind=fix.get("kind"), verified=fix.get("verified"), fix_code=fix.get("code"))
        edits = fix.get("edits") or ([{"before": fix["before"], "after": fix["after"]}]
                                     if fix.get("before") and fix.get("after") else [])
        row["edits"] = len(edits)
        if edits:
            patched = code / f"{name}.py"
            for e in edits:  # each is matched by its text, so the order they are applied in does not matter
                if Path(str(e.get("file") or patched)).name != patched.name or \
                        not apply_fix(patched, e["before"], e["after"]):
                    row["fix"] = "before-line not found in the user's code"
                    return row
            (tmp / "snaps2").mkdir()
            try:
                fixed = run_train(patched, tmp / "snaps2", tmp / "losses2.json", code)
            except CaseError as e:  # the fix as shown does not run: a wrong fix, not a case that failed
                row["fix"] = "the fixed loop " + str(e)[len("the training loop "):]
                return row
            broke_at = len(run["losses"]) - 1 if run["stop"] else len(run["losses"])  # its last loss is the failure
            healthy = range(min(case.BAD_STEP, broke_at, len(fixed["losses"])))
            rate = bool(expect) and "lr" in (fix.get("settings") or {})
            if rate:  # an edit of the run's learning rate changes every loss after the first update by design:
                healthy = range(1)  # only the first loss must be unchanged, and the fixed run must learn (below)
            model = fix.get("kind") == "positive_parametrisation"  # softplus for a ReLU: another model, every loss
            if model:                                               # changes by design; the fixed run must learn
                healthy = range(0)
            # unchanged within float32 noise: an epsilon or an exact form may move the last bits of a healthy value
            same = all(abs(fixed["losses"][i] - run["losses"][i]) <= 1e-4 * max(1.0, abs(run["losses"][i]))
                       for i in healthy)
            trained = fixed["stop"] is None and len(fixed["losses"]) == case.STEPS
            if flow.get("verdict"):  # a dead gradient stops nothing: the fixed run must write no snapshot either
                trained = trained and not any((tmp / "snaps2").glob("*.pt"))
            if rate or model:
                row["judged"] = ("a rate: the first loss unchanged, the last below the first" if rate else
                                 "a positive parametrisation (another model): the last loss below the first")
                trained = trained and fixed["losses"][-1] < fixed["losses"][0]
            row["fix"] = "right" if (trained and same) else \
                ("healthy values changed" if trained else f"still breaks ({fixed['stop']})")
        else:
            row["fix"] = "advice"
        return row
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def table(rows: list[dict]) -> str:
    out = ["| case | thread | localised | culprit | cause | fix (kind, verified) | applied |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['case']} | {r['cite']} | {'yes' if r.get('localised') else 'NO'} | "
                   f"`{r.get('op')}` {r.get('file')}:{r.get('line')} | {r.get('cause')} | "
                   f"{r.get('fix_kind')}, {r.get('verified')} | {r.get('fix')} |")
    n = len(rows)
    loc = sum(bool(r.get("localised")) for r in rows)
    right = sum(r.get("fix") == "right" for r in rows)
    out.append("")
    out.append(f"localised {loc}/{n} ({100 * loc / max(n, 1):.1f}%), applied fix right {right}/{n} "
               f"({100 * right / max(n, 1):.1f}%)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", nargs=3, metavar=("CASE", "FOLDER", "OUT"))
    ap.add_argument("--cases", nargs="*")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--dir", type=Path, default=HERE / "cases",
                    help="the cases' folder (wrong/: controls whose first fix is wrong when applied)")
    args = ap.parse_args()
    if args.train:
        train(Path(args.train[0]), Path(args.train[1]), Path(args.train[2]))
        return
    names = args.cases or sorted(p.stem for p in args.dir.glob("*.py"))
    rows = []
    for name in names:
        try:
            r = judge(name, keep=args.keep, cases=args.dir)
        except (CaseError, subprocess.TimeoutExpired) as e:
            r = {"case": name, "cite": load(args.dir / f"{name}.py").CITE, "localised": False, "fix": str(e)[:300]}
        rows.append(r)
        print(json.dumps(r), flush=True)
    text = table(rows)
    print(text)
    if not args.no_write:
        (HERE / "results.json").write_text(json.dumps(rows, indent=1))
        (HERE / "results.md").write_text("# Real-bug benchmark\n\n" + text + "\n")


if __name__ == "__main__":
    main()
