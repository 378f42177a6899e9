"""Magnitude provenance: which op made the finite-but-huge values that the culprit then overflowed.

The culprit is the op that crossed the line (DESIGN's definition): `mse_loss` squaring a std of
1e37 is where Inf appeared. But the story starts earlier, at the op that made the value huge
(`exp(0.5 * logvar)`). When the culprit's inputs are huge for their dtype, one more forward runs
on an independent copy under a tiny dispatch mode that keeps, per op, the largest |value| of its
output and of each input (numbers only) and which op or leaf each input came from. From the
culprit's largest input we walk back along the largest inputs; on that path the op that grew
values the most, into the huge range, is the magnitude origin (or the leaf: weights that are
already huge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nanreplay import replay, stats
from nanreplay import torch_internals as ti
from nanreplay.diagnose.site import Site, finite_float
from nanreplay.replay.recorder import value_outputs
from nanreplay.replay.subject import batch_tensors


def huge_limit(dtype: str) -> float:
    """From where a value counts as huge in `dtype`: its square overflows (float16: 1/64 of its range)."""
    fmax = torch.finfo(getattr(torch, dtype, torch.float32)).max
    return math.sqrt(fmax) if fmax > 1e30 else fmax / 64


def culprit_absmax(s: Site) -> float:
    return max((v for v in (finite_float(st.get("absmax")) for st in s.inputs) if v is not None), default=0.0)


@dataclass
class _Op:
    op: str
    out: float  # largest |value| of its floating outputs (inf when non-finite)
    inputs: list[tuple[int | str | None, float]] = field(default_factory=list)  # (producer op or leaf name, |max|)


class _Stop(Exception):
    pass


class _Probe(ti.TorchDispatchMode):
    def __init__(self, leaves: dict[int, str], stop_after: int):
        super().__init__()
        self.leaves, self.stop_after = leaves, stop_after
        self.ops: list[_Op] = []
        self.producer = ti.WeakTensorKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        i = len(self.ops)
        keep = value_outputs(func) if isinstance(out, (tuple, list)) else None
        rec = _Op(str(func), _absmax_of(out if keep is None else out[:keep]))  # (not a workspace's garbage)
        flat = [t for a in list(args) + list(kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))]
        for t in flat:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                src = self.producer.get(t)
                rec.inputs.append((src if src is not None else self.leaves.get(id(t)), _absmax_of(t)))
        self.ops.append(rec)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.producer[t] = i
        if i >= self.stop_after:
            raise _Stop
        return out


def _absmax_of(out) -> float:
    best = 0.0
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            v = stats.absmax(t)
            best = max(best, v if isinstance(v, float) else math.inf)
    return best


def _probe(subject, stop_after: int) -> list[_Op] | None:
    try:
        copy = subject.converted()
        leaves = {id(p): n for n, p in copy.model.named_parameters()}
        leaves.update({id(b): n for n, b in copy.model.named_buffers()})
        leaves.update({id(t): n for n, _, t in batch_tensors(copy)})
        if copy.prepare is not None:
            copy.prepare()
        mode = _Probe(leaves, stop_after)
        try:
            with replay.anomaly_off(), replay.autocast_from(copy.autocast), mode:
                copy.loss(copy.forward())
        except _Stop:
            pass
        return mode.ops
    except Exception:  # noqa: BLE001 - provenance is an extra: never a reason to fail the analysis
        return None


def origin_of(s: Site) -> dict | None:
    """The magnitude origin of the culprit's inputs, when they are huge; else None. Cached on the site."""
    if "_magnitude" in s.__dict__:
        return s.__dict__["_magnitude"]
    s.__dict__["_magnitude"] = None
    limit = huge_limit(s.dtype)
    if s.event.fwd is None or culprit_absmax(s) < limit:
        return None
    ops = _probe(s.subject, s.event.fwd)
    if not ops or len(ops) <= s.event.fwd or ops[s.event.fwd].op != str(s.step.ops[s.event.fwd].op):
        return None  # the probe did not run the same ops: no story rather than a wrong one
    path, leaf, i = [], None, s.event.fwd
    for _ in range(len(ops)):
        ins = [(src, v) for src, v in ops[i].inputs if math.isfinite(v)]
        if not ins:
            break
        src, v = max(ins, key=lambda sv: sv[1])
        if isinstance(src, str):
            leaf = (src, v)
            break
        if src is None or v < 1.0:
            break
        path.append(src)
        i = src
    grown = [(j, ops[j].out / max(max((v for _, v in ops[j].inputs if math.isfinite(v)), default=0.0), 1e-30))
             for j in path if math.isfinite(ops[j].out) and ops[j].out >= limit]
    out: dict = {"culprit_input_absmax": culprit_absmax(s), "huge_from": limit}
    if leaf is not None and leaf[1] >= limit:
        out["leaf"] = {"name": leaf[0], "absmax": leaf[1]}
    if grown:
        j, growth = max(grown, key=lambda jg: jg[1])
        if growth >= 10.0 or "leaf" not in out:
            rec = s.step.ops[j] if j < len(s.step.ops) and str(s.step.ops[j].op) == ops[j].op else None
            out.update(op=ops[j].op, module=rec.module if rec else None,
                       source=replay.frame_json(rec.frame) if rec else None,
                       input_absmax=max((v for _, v in ops[j].inputs if math.isfinite(v)), default=0.0),
                       output_absmax=ops[j].out, growth=growth, call=s.name_of(rec.call) if rec else None)
    if "op" not in out and "leaf" not in out:
        return None
    s.__dict__["_magnitude"] = out
    return out


def sentence(o: dict, s: Site) -> str:
    """The provenance, told: where the huge values came from."""
    head = (f"The values {s.event.op} overflowed were already huge (|x| up to {o['culprit_input_absmax']:.3g}, "
            f"beyond {o['huge_from']:.3g}, whose square overflows {s.dtype})")
    if "op" in o:
        src = o.get("source")
        at = f" at {src['file']}:{src['line']}" if src else ""
        mod = f" (module {o['module'] or '<root>'!r})" if o.get("module") is not None else ""
        call = f" ({o['call']})" if o.get("call") else ""
        text = (f"{head}: they were made huge by {o['op']}{call}{at}{mod}, which turned inputs of at most "
                f"{o['input_absmax']:.3g} into {o['output_absmax']:.3g} (×{o['growth']:.2g}).")
        if o.get("leaf"):
            text += f" Its inputs trace back to {o['leaf']['name']}, itself already at |x| = {o['leaf']['absmax']:.3g}."
        return text + " That op is where to look, not only the one that overflowed."
    leaf = o["leaf"]
    return f"{head}: they come straight from {leaf['name']}, already at |x| = {leaf['absmax']:.3g}."
