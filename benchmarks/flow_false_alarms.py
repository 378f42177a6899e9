"""False alarms of the gradient-flow triggers (no_gradient, gradient_died, gradient_vanished) on the zoo's healthy runs.

    python benchmarks/flow_false_alarms.py --limit 40 --steps 4

Each architecture of the capture sweep (benchmarks/archs.py) trains a few steps with Adam under NanGuard as the
README shows (begin, loss_ok, backward, grads_ok, step); a snapshot with any of them is a false alarm (these
runs are healthy: every parameter learns, or is unused by design). Prints each alarm with the parameters it named,
and `false alarms N of M architectures` (inert zeros are warnings: `warned`). Target: none. Also counts the steps
that needed the expensive check (a trained parameter with no or a zero gradient seen: the step recorded to ask
whether its value reaches the loss). The vanishing trigger needs history: give it `--steps 24` or more.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="*", help="only architectures whose name contains one of these")
    ap.add_argument("--limit", type=int, help="at most this many architectures (spread over the list)")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("nanreplay").setLevel(logging.ERROR)
    chosen = zoo_archs.select(zoo_archs.all_archs(), args.archs, args.limit)
    ran = alarms = warned = checked = 0
    closest = (float("inf"), "")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for i, arch in enumerate(chosen):
            sub = f"{folder}/{i}"
            CLOSEST[0] = float("inf")
            status, names, checks = run_one(arch, sub, args.steps)
            if CLOSEST[0] < float("inf"):
                closest = min(closest, (CLOSEST[0], arch.name))
                names = [*names, f"lowest share/median {CLOSEST[0]:.2g}"]
            if not status.startswith("skipped"):
                ran += 1
                alarms += status == "ALARM"
                warned += status == "warned"
                checked += checks
            print(f"{status[:60]:60s} {arch.name:45s} checks {checks}  {', '.join(names[:6])}", flush=True)
    print(f"\nfalse alarms {alarms} of {ran} architectures ({args.steps} steps each); inert parameters warned of "
          f"(no snapshot) in {warned}; steps that needed the expensive check: {checked}; "
          f"{time.perf_counter() - t0:.0f}s")
    if closest[1]:
        print(f"closest to the vanishing threshold (1e-4): share/median {closest[0]:.2g} ({closest[1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
