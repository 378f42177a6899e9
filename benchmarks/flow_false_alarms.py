"""False alarms of the gradient-flow triggers (no_gradient, gradient_died, gradient_vanished) on the zoo's healthy runs.

    python benchmarks/flow_false_alarms.py --limit 40 --steps 4

Each architecture of the capture sweep (benchmarks/archs.py) trains a few steps with Adam under NanGuard as the
README shows (begin, loss_ok, backward, grads_ok, step); a snapshot with any of them is a false alarm (these
runs are healthy: every parameter learns, or is unused by design). Prints each alarm with the parameters it named,
and `false alarms N of M architectures` (inert zeros are warnings: `warned`). Target: none. Also counts the steps
that needed the expensive check (a trained parameter with no or a zero gradient seen: the step recorded to ask
whether its value reaches the loss). The vanishing trigger needs history: give it `--steps 24` or more.
Also prints, per run and over the sweep, the absolute shares (module gradient norm / total, as the vanishing
trigger sums them): each module's highest over the first `--floor-steps` steps, the lowest module, the modules
below 1e-6 and 1e-8, and the input end's (the first three modules with a gradient: what the floor of
capture/vanish.py compares with 1e-7).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import archs as zoo_archs  # noqa: E402

from nanreplay import NanGuard  # noqa: E402
from nanreplay.replay.subject import call_model, compute_loss  # noqa: E402

SECONDS = 60
CLOSEST = [float("inf")]  # the lowest module share / its median share seen in a run (vanishing fires at 1e-4)
SHARES: dict[str, list[float]] = {}  # module -> its share of the gradient norm (module norm / total) on each step


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_one(arch, folder: str, steps: int) -> tuple[str, list[str], int]:
    """(status, the names an alarm gave, expensive checks)."""
    previous = signal.signal(signal.SIGALRM, _alarm)  # put back after: a caller's own handler (pytest's)
    signal.alarm(SECONDS)
    try:
        built = arch.make()
        model = built.model
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        guard = NanGuard(model, opt, loss_fn=built.loss_fn, folder=folder)
        checks = [0]
        real = guard._flow_check

        def counted(norm):
            if guard._flow is not None and guard._flow.pending:
                checks[0] += 1
            real(norm)
        guard._flow_check = counted
        vw = guard._flow.vanish if guard._flow is not None else None
        if guard._flow is not None:  # every module's absolute share on every step (the floor's measurement)
            measure = guard._flow.measure

            def measured(model_, optimizer, step_, want_norm):
                _record_shares(model_, optimizer)
                return measure(model_, optimizer, step_, want_norm)
            guard._flow.measure = measured
        if vw is not None:  # how close a healthy module's share came to the vanishing threshold (lowest share/median)
            seen = vw.observe

            def observed(*a, **k):
                out = seen(*a, **k)
                ratio = vw.closest() if out is not None else None
                if ratio is not None:
                    CLOSEST[0] = min(CLOSEST[0], ratio)
                return out
            vw.observe = observed
        for step in range(steps):
            inputs, target = built.batch(step)
            guard.begin(inputs, target, step=step)
            opt.zero_grad(set_to_none=True)
            loss = compute_loss(call_model(model, inputs), target, built.loss_fn)
            if not guard.loss_ok(loss):
                return "not finite", [], checks[0]
            loss.backward()
            guard.grads_ok()
            opt.step()
        guard.close()
        names = []
        for p in guard.flow_snapshots:
            d = torch.load(p, weights_only=True)
            names += [f"{r['name']} ({r['gradient']})" for r in d["gradient_flow"]["dead"]]
            names += [f"{v['module']} (vanished)" for v in d["gradient_flow"].get("vanished") or []]
        flow = guard._flow
        warned = [f"{n} (inert: warned)" for n in (flow.inert if flow is not None else ())]
        status = "ALARM" if guard.flow_snapshots else "warned" if warned else "quiet"
        return status, names + warned, checks[0]
    except zoo_archs.Skipped as e:
        return f"skipped: {e}", [], 0
    except _Timeout:
        return "skipped: too slow", [], 0
    except Exception as e:  # noqa: BLE001 - the world's code: record why, go on
        return f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", [], 0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _record_shares(model, optimizer) -> None:
    """Each module's gradient norm over the total (as the vanishing trigger sums them), with a non-zero norm."""
    names = {id(p): n for n, p in model.named_parameters()}
    sq: dict[str, float] = {}
    for p in model.parameters():
        if p.grad is not None and p.requires_grad:
            name = names.get(id(p), "")
            mod = name.rsplit(".", 1)[0] if "." in name else ""
            sq[mod] = sq.get(mod, 0.0) + float(p.grad.detach().float().norm()) ** 2
    total = sum(sq.values())
    if not total > 0 or total == float("inf"):
        return
    for mod, v in sq.items():
        if v > 0:
            SHARES.setdefault(mod, []).append((v / total) ** 0.5)


def lowest_share(shares: dict[str, list[float]], first: int) -> tuple[float, str]:
    """The lowest, over modules, of the module's *highest* share over the first `first` steps: what a floor that
    fires when a module stays below it for those steps would have to stay under (and the module)."""
    got = [(max(v[:first]), m) for m, v in shares.items() if len(v) >= first]
    return min(got) if got else (float("inf"), "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="*", help="only architectures whose name contains one of these")
    ap.add_argument("--limit", type=int, help="at most this many architectures (spread over the list)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--floor-steps", type=int, default=4,
                    help="the absolute share: each module's highest share over this many first steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("nanreplay").setLevel(logging.ERROR)
    chosen = zoo_archs.select(zoo_archs.all_archs(), args.archs, args.limit)
    ran = alarms = warned = checked = 0
    closest = (float("inf"), "")
    lowest = lowest_first = (float("inf"), "")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for i, arch in enumerate(chosen):
            sub = f"{folder}/{i}"
            CLOSEST[0] = float("inf")
            SHARES.clear()
            status, names, checks = run_one(arch, sub, args.steps)
            if CLOSEST[0] < float("inf"):
                closest = min(closest, (CLOSEST[0], arch.name))
                names = [*names, f"lowest share/median {CLOSEST[0]:.2g}"]
            floor = lowest_share(SHARES, args.floor_steps)
            below = {f: sorted(m for m, v in SHARES.items() if len(v) >= args.floor_steps and max(v[:args.floor_steps]) < f)
                     for f in (1e-6, 1e-8)}
            front = [(m, v) for m, v in SHARES.items() if len(v) >= args.floor_steps][:3]  # the input end
            if len(front) == 3:  # (registration order: the first three modules with a gradient)
                fmax = max(max(v[:args.floor_steps]) for _m, v in front)
                first = front[0]
                names = [*names, f"first modules {first[0] or '<root>'}.. {fmax:.2g}"]
                if not status.startswith("skipped"):
                    lowest_first = min(lowest_first, (fmax, f"{arch.name}: {first[0]}"))
            if below[1e-6]:
                names = [*names, f"below 1e-6: {len(below[1e-6])}, below 1e-8: {len(below[1e-8])} "
                         f"({', '.join(below[1e-6][:8])})"]
            if floor[1] or floor[0] < float("inf"):
                names = [*names, f"lowest share over {args.floor_steps} steps {floor[0]:.2g} ({floor[1] or '-'})"]
                if not status.startswith("skipped"):
                    lowest = min(lowest, (floor[0], f"{arch.name}: {floor[1]}"))
            if not status.startswith("skipped"):
                ran += 1
                alarms += status == "ALARM"
                warned += status == "warned"
                checked += checks
            shown = names[:3] + names[-2:] if len(names) > 5 else names
            print(f"{status[:60]:60s} {arch.name:45s} checks {checks}  {', '.join(shown)}", flush=True)
    print(f"\nfalse alarms {alarms} of {ran} architectures ({args.steps} steps each); inert parameters warned of "
          f"(no snapshot) in {warned}; steps that needed the expensive check: {checked}; "
          f"{time.perf_counter() - t0:.0f}s")
    if lowest[1]:
        print(f"lowest absolute share (a module's highest over the first {args.floor_steps} steps): "
              f"{lowest[0]:.2g} ({lowest[1]})")
    if lowest_first[1]:
        print(f"lowest share of the first three modules (their highest over the first {args.floor_steps} steps): "
              f"{lowest_first[0]:.2g} ({lowest_first[1]})")
    if closest[1]:
        print(f"closest to the vanishing threshold (1e-4): share/median {closest[0]:.2g} ({closest[1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
