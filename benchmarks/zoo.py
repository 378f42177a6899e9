"""The zoo benchmark: faults injected into real architectures, trained under NanGuard, analyzed, scored op by op.

    python benchmarks/zoo.py                          # the default zoo; writes benchmarks/zoo.{md,json}
    python benchmarks/zoo.py --archs hf:llama cnn --kinds sqrt_zero masked_row --limit 5 --no-write

Each (architecture, fault kind, precision) is one training run with the guard as the README shows: two
healthy steps, then the fault switched on at a random eligible site (seeded by --seed, architecture and
kind: reproducible), the loop stopping where the guard says so. The snapshot it wrote is analyzed in-process
(`nanreplay.analysis.analyze`) and scored against the recorded truth (benchmarks/zoo_faults.py): snapshot
written with the right trigger; culprit op = the injected op; module = the injected module; the source line
shown = the line a user would change; cause = the fault's family; fix offered, verified, plausible; analysis
wall time and peak memory as ratios to a plain load + forward + backward of the same step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import archs as zoo_archs  # noqa: E402
import zoo_faults as zf  # noqa: E402
from zoo_report import markdown, misses, table  # noqa: E402

from nanreplay import NanGuard  # noqa: E402
from nanreplay.analysis import analyze  # noqa: E402
from nanreplay.replay.subject import call_model, compute_loss  # noqa: E402

HERE = Path(__file__).resolve().parent
_TORCH_DIR = os.path.dirname(torch.__file__)
FAULT_STEP, STEPS = 2, 5
# The default zoo: one architecture per family and kind of model code, ≥ 30 (benchmarks/capture_sweep.md has all).
DEFAULT_ARCHS = (  # interleaved, so that a run cut short (the table is written after each architecture) is diverse
    "hf:llama", "cnn:resnet", "hf:bert", "hf:vit", "nn:TransformerEncoderLayer", "hf:t5", "hf:mixtral",
    "rnn:lstm_lm", "hf:whisper", "hf:mamba", "hf:gpt2", "loss:CrossEntropyLoss", "hf:roberta", "hf:deit",
    "diffusers:UNet2DModel", "hf:bart", "hf:qwen2_moe", "nn:GRU", "hf:wav2vec2", "hf:bamba", "hf:mistral",
    "nn:LayerNorm", "hf:distilbert", "hf:resnet", "diffusers:AutoencoderKL", "hf:mbart", "hf:qwen2", "rnn:gru_lm",
    "hf:gpt_neox", "hf:electra", "nn:Conv1d", "hf:phi3", "hf:gemma", "hf:opt", "nn:BatchNorm2d", "nn:GroupNorm",
    "nn:RMSNorm", "nn:MultiheadAttention", "nn:Transformer", "nn:LSTM", "loss:BCEWithLogitsLoss", "loss:MSELoss",
)


@dataclass
class Result:
    arch: str
    family: str
    kind: str
    precision: str
    status: str  # scored | not_eligible | no_snapshot | analysis_failed
    reason: str = ""
    site: str = ""  # the injected module (or weight / sample)
    trigger: str = ""
    verdict: str = ""
    culprit_op: str = ""
    culprit_module: str = ""
    culprit_line: str = ""
    cause: str = ""
    fix_kind: str = ""
    scores: dict = field(default_factory=dict)  # snapshot, op, module, line, cause, fix_offered, fix_verified, ...
    time_ratio: float | None = None
    memory_ratio: float | None = None
    analysis_seconds: float | None = None


class _NotEligible(Exception):
    pass


class _Peak:
    """Peak resident memory (bytes above the start) while the block runs, sampled every 2 ms."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self.done = False
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()
        self.peak = max(self.peak, _rss())
        self.used = max(self.peak - self.start, 1 << 16)
        return False


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _autocast(precision: str):
    if precision in ("bf16", "fp16"):
        return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    return _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _sites(built) -> list[tuple[str, object, int | str]]:
    """Modules on the forward path whose input is an activation: (name, module, which argument), call order."""
    names = {id(m): n for n, m in built.model.named_modules()}
    found: dict[str, tuple[str, object, int | str]] = {}

    def pre(mod, args, kwargs):
        n = names.get(id(mod))
        if n and n not in found:
            a = zf.activation_arg(args, kwargs)
            if a is not None:
                found[n] = (n, mod, a)

    _forward_once(built, [m.register_forward_pre_hook(pre, with_kwargs=True) for m in built.model.modules()])
    return list(found.values())


def _linear_sites(built) -> list[tuple[str, torch.nn.Module]]:
    used = set()

    def hook(mod, args):
        used.add(id(mod))

    mods = [(n, m) for n, m in built.model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d,
                                                                             torch.nn.Conv2d)) and n]
    _forward_once(built, [m.register_forward_pre_hook(hook) for _, m in mods])
    return [(n, m) for n, m in mods if id(m) in used]


def _forward_once(built, handles: list) -> None:
    """One forward and loss of the built model on its first batch, with these hooks in place; then remove them."""
    try:
        x, y = built.batch(0)
        compute_loss(call_model(built.model, x), y, built.loss_fn)
    finally:
        for h in handles:
            h.remove()


@dataclass
class Trained:
    """One faulty training run: what was built, the fault's plan (its truth), the guard, the losses, an error."""

    built: object
    plan: object
    guard: NanGuard
    losses: list = field(default_factory=list)
    stop: str | None = None  # loss | grads | update: where the guard stopped the loop (None: every step ran)
    raised: str = ""  # "Type: message" when the loop raised


def train_faulty(arch, kind: zf.Kind, precision: str, seed: int, folder: str, res: Result) -> Trained | None:
    """Build the architecture and train it with the fault under NanGuard as the README shows (the loop stops
    where the guard says so). None when the fault is not eligible here (res.reason says why)."""
    rng = random.Random(f"{seed}:{arch.name}:{kind.name}:{precision}")
    try:
        built = arch.make()
    except Exception as e:  # noqa: BLE001
        res.reason = f"not built: {type(e).__name__}: {str(e)[:120]}"
        return None
    model, loss_fn = built.model, built.loss_fn
    try:
        _trains_in(built, precision)
        plan = _plan(built, kind, precision, rng, res)
    except _NotEligible as e:
        res.reason = str(e)
        return None
    lr = 1e-3
    if kind.how == "optimizer":
        model.half()
        opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-8)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = None
    if kind.how == "schedule":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float("inf") if s >= FAULT_STEP else 1.0)
    run_dir = os.path.join(folder, f"{len(os.listdir(folder))}")
    guard = NanGuard(model, opt, loss_fn=loss_fn, folder=run_dir, scheduler=sched)
    t = Trained(built, plan, guard)
    try:
        with guard:
            for step in range(STEPS + (3 if kind.how == "lr" else 0)):
                if step == FAULT_STEP:
                    plan.on(opt)
                x, y = built.batch(step)
                if kind.how == "optimizer":
                    x = _half(x)
                if step >= FAULT_STEP:
                    x, y = plan.data(x, y)
                guard.begin(x, y, step=step)
                opt.zero_grad()
                with _autocast(precision):
                    loss = compute_loss(call_model(model, x), y, loss_fn)
                t.losses.append(float(loss.detach()))
                if not guard.loss_ok(loss):
                    t.stop = "loss"
                    break
                loss.backward()
                if not guard.grads_ok():
                    t.stop = "grads"
                    break
                opt.step()
                if sched is not None:
                    sched.step()
                if not guard.update_ok():
                    t.stop = "update"
                    break
    except Exception as e:  # noqa: BLE001 - the caller decides what a raise counts as
        t.raised = f"{type(e).__name__}: {str(e)[:150]}"
    finally:
        plan.off()
    return t


def run_one(arch, kind: zf.Kind, precision: str, seed: int, folder: str) -> Result:
    res = Result(arch.name, arch.family, kind.name, precision, "not_eligible")
    t = train_faulty(arch, kind, precision, seed, folder, res)
    if t is None:
        return res
    if t.raised:  # the fault made the model's own code raise (not a NaN): not counted here
        res.status, res.reason = "not_eligible", f"the faulty step raised {t.raised}"
        return res
    built, plan, guard = t.built, t.plan, t.guard
    path = guard.last_snapshot
    res.trigger = str(guard.last_trigger or "")
    if path is None:
        res.status = "no_snapshot" if res.trigger else "no_failure"
        res.reason = guard.last_error or ("the fault did not make training non-finite" if not res.trigger else
                                          f"trigger {res.trigger}, but no snapshot written")
        return res
    res.scores["snapshot"] = res.trigger in kind.triggers
    if guard.last_error:
        res.reason = f"no step program: {guard.last_error}"
    baseline = _baseline(path, built, precision, kind)
    t0 = time.perf_counter()
    try:
        with _Peak() as peak:
            a = analyze(path, source=[str(HERE)]).to_json()
    except Exception as e:  # noqa: BLE001
        res.status = "analysis_failed"
        res.reason = (res.reason + "; " if res.reason else "") + f"{type(e).__name__}: {str(e)[:200]}"
        return res
    res.analysis_seconds = round(time.perf_counter() - t0, 3)
    res.time_ratio = round(res.analysis_seconds / baseline[0], 2) if baseline else None
    res.memory_ratio = round(peak.used / baseline[1], 2) if baseline else None
    res.status = "scored"
    _score(res, a, kind, plan)
    return res


def _trains_in(built, precision: str) -> None:
    """One healthy forward + backward in this precision's autocast, or _NotEligible (CPU kernels without
    bf16/fp16 support, e.g. the oneDNN LSTM)."""
    if precision not in ("bf16", "fp16"):
        return
    try:
        x, y = built.batch(0)
        with _autocast(precision):
            loss = compute_loss(call_model(built.model, x), y, built.loss_fn)
        loss.backward()
    except Exception as e:  # noqa: BLE001
        raise _NotEligible(f"does not train under {precision} autocast on CPU: {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:100]}") from None
    finally:
        built.model.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        raise _NotEligible(f"the loss is not finite under {precision} autocast before any fault")


def _half(x):
    if isinstance(x, torch.Tensor):
        return x.half() if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _half(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_half(v) for v in x)
    return x


class _Plan:
    """What one fault does: switched on at the fault step (`on`), editing the batch (`data`)."""

    def __init__(self):
        self.module = ""  # the truth: the module the culprit op runs in
        self.line: int | None = None  # the line in zoo_faults.py a user would change
        self.sample: int | None = None
        self.call_site: tuple[str, int] | None = None  # (file, line) of the model's line calling the faulty module
        self.undo = []

    def record_call_site(self, module, args):
        """A forward pre-hook: the innermost frame outside torch is the model's line that calls the module."""
        if self.call_site is None:
            f = sys._getframe(1)
            while f is not None and (f.f_code.co_filename.startswith(_TORCH_DIR) or f.f_code.co_filename == __file__):
                f = f.f_back
            if f is not None:
                self.call_site = (f.f_code.co_filename, f.f_lineno)

    def on(self, opt):
        pass

    def data(self, x, y):
        return x, y

    def off(self):
        for u in self.undo:
            u()


def _plan(built, kind: zf.Kind, precision: str, rng: random.Random, res: Result) -> _Plan:
    plan = _Plan()
    if kind.how == "site":
        sites = _sites(built)
        if not sites:
            raise _NotEligible("no module on the forward path takes a float activation")
        name, mod, arg = rng.choice(sites)
        hook = zf.SiteHook(kind.name, 0, arg)
        handle = mod.register_forward_pre_hook(hook, with_kwargs=True)
        plan.module, plan.line, res.site = name, zf.site_line(kind.name), name

        def on(opt, hook=hook):
            hook.on = True
        plan.on = on
        plan.undo.append(handle.remove)
        return plan
    if kind.how == "weight":
        sites = _linear_sites(built)
        rng.shuffle(sites)
        for name, mod in sites[:6]:
            w = mod.weight
            scale = 3e4 / float(w.detach().abs().max())
            plan.module, res.site = name, f"{name}.weight x{scale:.0f}"
            plan.undo.append(mod.register_forward_pre_hook(plan.record_call_site).remove)

            def on(opt, w=w, scale=scale):
                with torch.no_grad():
                    w.mul_(scale)
            plan.on = on
            return plan
        raise _NotEligible("no Linear/Conv layer on the forward path")
    if kind.how == "data":
        x, y = built.batch(0)
        target = _float_leaf(x) or _float_leaf(y, "target")
        if target is None:
            raise _NotEligible("no float tensor in the batch (token ids only)")
        sample = rng.randrange(2)
        plan.sample, res.site = sample, f"{target} sample {sample}"

        def data(x, y, sample=sample):
            if _float_leaf(x):
                return _nan_sample(x, sample), y
            return x, _nan_sample(y, sample)
        plan.data = data
        return plan
    if kind.how == "lr":
        k = rng.choice((8, 10, 12))
        res.site = f"lr x1e{k}"

        def on(opt, k=k):
            for g in opt.param_groups:
                g["lr"] *= 10 ** k
        plan.on = on
        return plan
    if kind.how in ("optimizer", "schedule"):
        res.site = "optimizer" if kind.how == "optimizer" else "LambdaLR returns inf"
        if kind.how == "optimizer":
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    m = built.model.half()
                    x, y = built.batch(0)
                    loss = compute_loss(call_model(m, _half(x)), y, built.loss_fn)
                    loss.backward()
                    m.zero_grad(set_to_none=True)
                    if not torch.isfinite(loss):
                        raise _NotEligible("the half-precision model's loss is not finite before any fault")
            except _NotEligible:
                raise
            except Exception as e:  # noqa: BLE001
                raise _NotEligible(f"does not run in half precision on CPU: {type(e).__name__}") from None
        return plan
    raise KeyError(kind.how)


def _float_leaf(x, name="inputs"):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return name
    if isinstance(x, dict):
        for k, v in x.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return k
    if isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return f"{name}[{i}]"
    return None


def _nan_sample(x, sample):
    if isinstance(x, torch.Tensor):
        x = x.clone()
        x[sample].view(-1)[0] = float("nan")
        return x
    if isinstance(x, dict):
        k = _float_leaf(x)
        return {**x, k: _nan_sample(x[k], sample)}
    if isinstance(x, (tuple, list)):
        out = list(x)
        for i, v in enumerate(out):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                out[i] = _nan_sample(v, sample)
                break
        return type(x)(out)
    return x


def _baseline(path: str, built, precision: str, kind) -> tuple[float, int] | None:
    """A plain load + forward + backward of the snapshot's step (the model's own code): (seconds, bytes)."""
    try:
        t0 = time.perf_counter()
        with _Peak() as peak:
            d = torch.load(path, weights_only=True)
            x, y = d["batch"]["inputs"], d["batch"]["target"]
            with _autocast(precision):
                loss = compute_loss(call_model(built.model, x), y, built.loss_fn)
            loss.backward()
        return max(time.perf_counter() - t0, 1e-4), peak.used
    except Exception:  # noqa: BLE001 - no baseline: no ratio
        return None


def _score(res: Result, a: dict, kind: zf.Kind, plan: _Plan) -> None:
    c = a.get("culprit") or {}
    diag = a.get("diagnosis") or {}
    fix = diag.get("fix") or {}
    src = c.get("source") or {}
    res.verdict = a.get("verdict", "")
    res.culprit_op = str(c.get("forward_op") or c.get("op") or "")
    res.culprit_module = str(c.get("module") or "")
    res.culprit_line = f"{os.path.basename(str(src.get('file') or ''))}:{src.get('line')}" if src else ""
    res.cause = str(diag.get("cause") or "")
    res.fix_kind = str(fix.get("kind") or "")
    s = res.scores
    op_packet = ".".join(res.culprit_op.split(".")[:2])
    if kind.ops:
        s["op"] = op_packet in kind.ops
        s["module"] = res.culprit_module == plan.module
    elif kind.how == "data":
        leaves = a.get("nonfinite_leaves") or []
        s["op"] = res.verdict == "nonfinite_input"
        s["module"] = any(plan.sample in (r.get("samples") or []) for r in leaves)
    else:  # lr / optimizer / schedule: the failure's place is the update (or the diverged step)
        s["op"] = None
        s["module"] = None
    if plan.line is not None:
        s["line"] = src.get("line") == plan.line and os.path.basename(str(src.get("file") or "")) == "zoo_faults.py"
    s["cause"] = res.cause in kind.causes or (kind.how == "data" and res.verdict == "nonfinite_input")
    s["fix_offered"] = bool(res.fix_kind) and res.fix_kind != "none"
    s["fix_verified"] = fix.get("verified") is True
    s["fix_plausible"] = res.fix_kind in kind.fixes and bool((fix.get("replay") or {}).get("plausible", True))
    s["localised"] = all(s.get(k) is not False for k in ("snapshot", "op", "module", "cause"))


def _runs(arch: str, kinds: list[zf.Kind], args) -> list[tuple[zf.Kind, str]]:
    """The (kind, precision) runs of one architecture. By default a seeded draw of --kinds-per-arch kinds, each
    in one of its precisions (so fp32 and bf16 both occur across the zoo); --full: every kind in every precision."""
    runs = [(k, p) for k in kinds for p in (args.precisions or k.precisions) if p in k.precisions]
    if args.full or args.kinds or args.precisions:
        return runs
    rng = random.Random(f"{args.seed}:{arch}:runs")
    chosen = rng.sample(kinds, min(args.kinds_per_arch, len(kinds)))
    return [(k, rng.choice(k.precisions)) for k in kinds if k in chosen]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="*", help="architectures whose name contains one of these (default: the zoo list)")
    ap.add_argument("--all-archs", action="store_true", help="every architecture of the capture sweep")
    ap.add_argument("--kinds", nargs="*", choices=sorted(zf.KINDS), help="fault kinds (default: all)")
    ap.add_argument("--precisions", nargs="*", help="fp32 bf16 fp16 half (default: each kind's own)")
    ap.add_argument("--limit", type=int, help="at most this many architectures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds-per-arch", type=int, default=8, help="fault kinds drawn per architecture (default 8)")
    ap.add_argument("--full", action="store_true", help="every fault kind in every precision on every architecture")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", default=str(HERE / "zoo"))
    ap.add_argument("--render", metavar="JSON", help="only rewrite the tables from a zoo.json this script wrote")
    args = ap.parse_args(argv)
    if args.render:
        d = json.loads(Path(args.render).read_text())
        write(args, argv, [Result(**r) for r in d["results"]])
        return 0
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("nanreplay").setLevel(logging.CRITICAL)
    every = zoo_archs.all_archs()
    if args.archs:
        chosen = zoo_archs.select(every, args.archs, args.limit)
    elif args.all_archs:
        chosen = zoo_archs.select(every, None, args.limit)
    else:
        by_name = {a.name: a for a in every}
        chosen = zoo_archs.select([by_name[n] for n in DEFAULT_ARCHS if n in by_name], None, args.limit)
    kinds = [zf.KINDS[k] for k in (args.kinds or zf.KINDS)]
    results: list[Result] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for arch in chosen:
            for kind, prec in _runs(arch.name, kinds, args):
                r = run_one(arch, kind, prec, args.seed, folder)
                if r.reason.startswith("does not train under") and "fp32" in kind.precisions and prec != "fp32":
                    results.append(r)  # listed as not eligible; the fault still runs, in fp32
                    r = run_one(arch, kind, "fp32", args.seed, folder)
                results.append(r)
                ok = r.scores.get("localised")
                mark = "ok  " if ok else "--  " if r.status in ("not_eligible", "no_failure") else "MISS"
                print(f"{mark} {arch.name:28s} "
                      f"{kind.name:18s} {prec:5s} {r.status:15s} {r.culprit_op:28s} {r.cause:22s} "
                      f"{r.fix_kind}{'✓' if r.scores.get('fix_verified') else ''}  {r.reason[:90]}", flush=True)
            if not args.no_write:
                write(args, argv, results)
    t = table(results)
    print(f"\nlocalisation {t['localisation_percent']}% · verified fixes {t['verified_fix_percent']}% over {t['runs']} "
          f"runs ({t['architectures']} architectures, {t['kinds']} kinds) in {time.perf_counter() - t0:.0f}s")
    for r in misses(results):
        print(f"  miss: {r.arch} {r.kind} {r.precision}: {r.status} {r.verdict} {r.culprit_op} @ {r.culprit_module!r} "
              f"cause={r.cause} (site {r.site}) {r.reason[:120]}")
    return 0


def write(args, argv, results: list[Result]) -> None:
    """The table so far (rewritten after each architecture: a run cut short still leaves one)."""
    from capture_sweep import versions

    v, t = versions(), table(results)
    line = "python benchmarks/zoo.py " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out + ".json").write_text(json.dumps({"versions": v, "seed": args.seed, "table": t,
                                                    "results": [asdict(r) for r in results]}, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(t, results, v, line.strip()))


if __name__ == "__main__":
    sys.exit(main())
