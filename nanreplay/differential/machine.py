"""Is it the machine? The guard's in-process re-run of the failing step beside the training step itself.

The guard records a failing step by running it once more, at once, in the same process on the same device, from
the state the step began with (capture/rerun.py writes what that re-run gave, and what the training step gave, into
the snapshot's `rerun` field). A re-run that is finite where the training step was not — or, for a finite trigger,
one that differs bit for bit — while nothing in the step is nondeterministic by declaration is the strongest
evidence of a transient (hardware) fault there is: the same computation gave another answer on the same device.

Verdicts (`VERDICTS`):

* `transient` — the failure did not recur in the re-run, and nothing declared explains it;
* `reproducible` — the re-run failed again (the cause is in the step: the analysis's replay names it);
* `inconclusive` — the failure did not recur, but the re-run is not the same computation by declaration: random ops
  drew from a generator the guard did not record, or the training step ran compiled and the re-run eagerly
  (deterministic algorithms off on an accelerator is recorded too, but sums in a varying order change last bits,
  not finite into NaN/Inf: a `transient` verdict then says so);
* `skipped` — no re-run record (an older snapshot, an update snapshot, export=False): `skipped` says why.

It replays nothing: it reads what capture recorded, and compares with the analysis's own replay where there is one.
Pure data in, data out (no torch): triage's rows and the renderers read its dict.
"""

from __future__ import annotations

import math
import time
from typing import Any

VERDICTS = ("transient", "reproducible", "inconclusive", "skipped")
QUESTION = "is it the machine: did the same step, re-run in the same process on the same device, fail again?"
_SPIKE_KEEP = 0.5  # a spike is reproduced when the re-run's gradient norm is at least this share of the training one's


def analyze(raw: dict, *, replay: dict | None = None, culprit_found: bool = False) -> dict | None:
    """`Analysis.differential["machine"]` for a snapshot's raw fields (formats/native.py validated them), or None
    where the question does not arise (no record, and the analysis's replay named a culprit: a plain culprit).

    `replay`: the analysis's own replay, {"where", "loss", "loss_finite", "grads_finite"}, compared with the re-run."""
    t0 = time.perf_counter()
    rec = raw.get("rerun") if isinstance(raw.get("rerun"), dict) else None
    ident = identity(raw)
    trigger = raw.get("trigger")
    if rec is None:
        if culprit_found:
            return None
        why = ("an update snapshot: the failure was in optimizer.step(), which the guard's re-run does not repeat"
               if trigger == "update" else "the snapshot holds no record of the guard's re-run (written by an older "
               "nanreplay, or not by NanGuard)")
        return _out("skipped", f"Not checked: {why}.", [], why, ident, [], t0)
    training, rerun = rec.get("training") or {}, rec.get("rerun")
    ran = [_row("training step", ident, training)]
    if rerun is None:
        why = rec.get("why_not") or "the snapshot records no re-run"
        return _out("skipped", f"Not checked: {why}.", ran, why, ident, [], t0)
    ran.append(_row("guard's re-run (same process, same device)", ident, rerun))
    if replay is not None:
        ran.append({"what": "analysis replay", "where": replay.get("where"), "loss": replay.get("loss"),
                    "loss_finite": replay.get("loss_finite"), "grads_finite": replay.get("grads_finite")})
    finite = _finite_here(trigger, training, raw)
    if finite:  # nothing failed on this rank: there is no failure to re-check
        return _out("skipped", f"Not checked: {finite}.", ran, finite, ident, [], t0)
    declared = declared_nondeterminism(rec, raw)
    failed_again, how = _failed_again(trigger, training, rerun, raw)
    bitwise = _bitwise(rec, training, rerun)
    dev = ident.get("device") or "its device"
    if failed_again:
        also = ""
        if bitwise is False and not declared["order"] and not declared["draws"]:
            also = " (not bit for bit, though nothing in the step is declared nondeterministic)"
        return _out("reproducible", f"Reproducible: the same step, re-run in the same process on {dev}, {how} again"
                    f"{also}; the cause is in the step, not the machine.", ran, None, ident, declared["all"], t0,
                    bitwise=bitwise)
    if declared["draws"]:
        return _out("inconclusive", f"Inconclusive: the re-run on {dev} {how}, but it is not the same computation "
                    f"as the training step: {'; '.join(declared['draws'])}.", ran, None, ident, declared["all"], t0,
                    bitwise=bitwise)
    caveat = f" ({declared['order'][0]}: that changes the last bits of sums, not finite into NaN/Inf)" \
        if declared["order"] else ""
    where = f"{dev} on {ident['host']}" if ident.get("host") else dev
    evidence = f"the same step, re-run in the same process on {where}, {how}"
    out = _out("transient", f"Transient: {evidence}, and nothing in the step is nondeterministic by declaration"
               f"{caveat}: a fault of the machine (hardware, or memory corrupted by other code), not of the model.",
               ran, None, ident, declared["all"], t0, bitwise=bitwise)
    out["evidence"] = evidence
    return out


def identity(raw: dict) -> dict:
    """Which host, device, rank and run the snapshot came from (`machine` field, `rank`, `environment.device`)."""
    m = raw.get("machine") if isinstance(raw.get("machine"), dict) else {}
    env = raw.get("environment") if isinstance(raw.get("environment"), dict) else {}
    rank = raw.get("rank")
    return {"host": m.get("host"), "device": m.get("device") or env.get("device"),
            "device_name": m.get("device_name"), "rank": rank if isinstance(rank, int) else None,
            "run": m.get("run")}


def declared_nondeterminism(rec: dict, raw: dict) -> dict:
    """What makes the re-run another computation by declaration: `draws` (other numbers drawn, another program,
    other inputs: any difference is explained) and `order` (sums in a varying order: last-bit differences)."""
    draws, order = [], []
    world = raw.get("world_size") if isinstance(raw.get("world_size"), int) else 1
    if world > 1 and raw.get("trigger") in ("gradient", "grad_norm_overflow", "grad_spike"):
        draws.append(f"the training step's gradients came through the all-reduce of {world} ranks, the re-run's are "
                     "this rank's own")
    unrecorded = rec.get("random_unrecorded") or 0
    if unrecorded:
        kinds = sorted({r.get("generator") for r in rec.get("random_ops") or [] if r.get("generator") != "recorded"})
        ops = sorted({r.get("op") for r in rec.get("random_ops") or [] if r.get("generator") != "recorded"})
        draws.append(f"{unrecorded} random op{'s' if unrecorded != 1 else ''} ({', '.join(map(str, ops[:3]))}) drew "
                     f"from a generator the guard did not record ({', '.join(map(str, kinds))}), so the re-run drew "
                     "other numbers")
    env = raw.get("environment") if isinstance(raw.get("environment"), dict) else {}
    if rec.get("compiled") or env.get("compiled") is True:  # either record says so: the snapshot's environment too
        draws.append("the training step ran torch.compile'd, the re-run eagerly (other kernels)")
    det = rec.get("deterministic") or {}
    device = str(env.get("device") or "")  # where the step really ran (the identity may be a fleet's own name)
    if device and not device.startswith("cpu") and det.get("algorithms") is False:
        order.append(f"deterministic algorithms were off on {device}")
    return {"draws": draws, "order": order, "all": draws + order}


def _finite_here(trigger: Any, training: dict, raw: dict) -> str | None:
    """Why the question does not arise, where the training step itself was finite on this rank: it wrote the
    snapshot because another rank failed (the guard's rank agreement, `sync_ranks=True`). None otherwise."""
    ranks, rank = raw.get("nonfinite_ranks"), raw.get("rank")
    if not isinstance(ranks, list) or not isinstance(rank, int) or rank in ranks:
        return None
    if trigger == "loss" and training.get("loss_finite") is not True:
        return None
    if trigger in ("gradient", "grad_norm_overflow") and training.get("grads_nonfinite") not in (0, None):
        return None
    names = ", ".join(str(r) for r in ranks if isinstance(r, int))
    return (f"this rank's training step was finite; it wrote the snapshot because rank{'s' if len(ranks) > 1 else ''} "
            f"{names} failed at this step (the ranks agree at each check, sync_ranks=True)")


def _failed_again(trigger: Any, training: dict, rerun: dict, raw: dict) -> tuple[bool, str]:
    """Did the re-run fail the way the training step did? And how the re-run went, in words."""
    loss, norm, bad = rerun.get("loss"), rerun.get("grad_norm"), rerun.get("grads_nonfinite")
    if trigger == "loss" or rerun.get("loss_finite") is False:
        if rerun.get("loss_finite") is False:
            return True, f"made the loss {_num(loss)}"
        if trigger == "loss":
            return False, f"was finite (loss {_num(loss)}; the training step's was {_num(training.get('loss'))})"
    if trigger == "gradient":
        if bad:
            return True, f"made {bad} gradient entr{'ies' if bad != 1 else 'y'} non-finite"
        if bad is None:
            return True, "computed no gradients to compare (counted as failing again)"
        if isinstance(norm, (int, float)) and not math.isfinite(norm):  # entries at the edge of float32's range:
            return True, (f"made every gradient entry finite but overflowed their float32 norm ({_num(norm)}): the "
                          "same gradients at the edge of float32's range, not a finite step")
        return False, f"was finite (loss {_num(loss)}, every gradient entry finite, gradient norm {_num(norm)})"
    if trigger == "grad_norm_overflow":
        if norm is None or not math.isfinite(norm):
            return True, "overflowed the float32 gradient norm"
        return False, f"had a finite gradient norm ({_num(norm)})"
    if trigger == "grad_spike":
        was = training.get("grad_norm")
        if norm is None or not isinstance(was, (int, float)) or not math.isfinite(was) or norm >= _SPIKE_KEEP * was:
            return True, f"spiked (gradient norm {_num(norm)})"
        return False, f"had a gradient norm of {_num(norm)}, not the training step's {_num(was)}"
    return True, "ran"


def _bitwise(rec: dict, training: dict, rerun: dict) -> bool | None:
    """Were the re-run's loss (and gradients, where both were hashed comparably) the training step's bits?
    None: nothing comparable."""
    comp = rec.get("comparable") or {}
    same = []
    if comp.get("loss") and training.get("loss_hash") and rerun.get("loss_hash"):
        same.append(training["loss_hash"] == rerun["loss_hash"])
    if comp.get("grads") and training.get("grads_hash") and rerun.get("grads_hash"):
        same.append(training["grads_hash"] == rerun["grads_hash"])
    return all(same) if same else None


def _row(what: str, ident: dict, s: dict) -> dict:
    where = " on ".join(str(x) for x in (ident.get("device"), ident.get("host")) if x)
    return {"what": what, "where": where or None, "loss": s.get("loss"), "loss_finite": s.get("loss_finite"),
            "grads_finite": None if s.get("grads_nonfinite") is None else s["grads_nonfinite"] == 0,
            "grad_norm": s.get("grad_norm"), "grads_nonfinite": s.get("grads_nonfinite"),
            "loss_hash": s.get("loss_hash"), "grads_hash": s.get("grads_hash")}


def _num(v: Any) -> str:
    from nanreplay.numbers import num

    return num(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "unknown"


def _out(verdict: str, sentence: str, ran: list, skipped: str | None, ident: dict, declared: list[str], t0: float,
         *, bitwise: bool | None = None) -> dict:
    return {"question": QUESTION, "ran": ran, "verdict": verdict, "sentence": sentence, "skipped": skipped,
            "seconds": round(time.perf_counter() - t0, 6), "identity": ident, "declared_nondeterminism": declared,
            "bitwise_equal": bitwise}


def attach(result: Any, snap: Any, device: Any, step: Any, culprit_found: bool) -> None:
    """The pipeline's call (analysis/pipeline.py): `result.differential["machine"]`, where the question arises."""
    raw = getattr(snap, "raw", None)
    loss = result.loss if isinstance(result.loss, (int, float)) else None
    replay = {"where": str(device), "loss": loss, "loss_finite": loss is not None and math.isfinite(loss),
              "grads_finite": getattr(step, "failure", None) is None}
    out = analyze(raw if isinstance(raw, dict) else {}, replay=replay, culprit_found=culprit_found)
    if out is not None:
        result.differential = {**(result.differential or {}), "machine": out}
