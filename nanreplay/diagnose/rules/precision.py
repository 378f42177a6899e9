"""Range and magnitude, for any op: training that diverged, a float16 overflow, weights that had
already exploded, values made huge upstream. They claim any op, so they rank below every rule for
a specific op. Divergence outranks the rest (the history says why everything is huge); a float16
overflow outranks exploded weights (both claim Inf from finite inputs; the wider dtype is the
fix); values made huge by an op upstream come last before the generic answer."""

from __future__ import annotations

import math

import torch

from nanreplay.diagnose import magnitude, plausible
from nanreplay.diagnose.divergence import divergence, lr_clip_fix, remedy
from nanreplay.diagnose.edits import upcast
from nanreplay.diagnose.model import Diagnosis, Fix, rule
from nanreplay.diagnose.site import Site, finite_float, packet
from nanreplay.enums import FixKind


def _low_dtype(s: Site) -> str | None:
    """'float16' / 'bfloat16' when the step ran in that dtype or under autocast to it, else None."""
    if s.dtype in ("float16", "bfloat16"):
        return s.dtype
    auto = s.subject.autocast
    if auto:
        return str(auto.get("dtype", "float16")).removeprefix("torch.")
    return None


def _huge_weights(s: Site, limit: float) -> list[tuple[str, float]]:
    big = [(n, float(p.detach().abs().max())) for n, p in s.subject.model.named_parameters()
           if p.is_floating_point() and p.numel()]
    return sorted(((n, v) for n, v in big if v > limit), key=lambda nv: -nv[1])


@rule("training_diverged", priority=35)
def _diverged(s: Site) -> Diagnosis | None:
    """The history climbs (loss, gradient norm) and the values are huge: the run diverged before this step."""
    if s.event.role not in ("origin", "conversion"):
        return None
    d = divergence(s.info)
    if d is None:
        return None
    seen = magnitude.culprit_absmax(s)
    weights = _huge_weights(s, 1e3)
    if seen < magnitude.huge_limit(s.dtype) and not weights:
        return None  # the history climbs, but this op saw nothing huge: something else broke it
    origin = magnitude.origin_of(s)
    facts = [f"this op's inputs reached |x| = {seen:.3g}"] if seen else []
    if weights:
        facts.append("the largest weights: " + ", ".join(f"{n} |w| = {v:.3g}" for n, v in weights[:3]))
    act = [a for a in s.step.activations if isinstance(a[1], float)]
    if act:
        m, v, _ = max(act, key=lambda a: a[1])
        facts.append(f"the largest activation: module {m or '<root>'!r} |x| = {v:.3g}")
    what = {"nan": "NaN (e.g. inf − inf inside the op)", "inf": "Inf"}[s.event.kind]
    expl = (f"Training diverged: {d.story}. By this step {'; '.join(facts)}, and {s.event.op} made {what} at "
            f"{s.where}. The op is where it finally broke, not the bug: the updates were too large for this model "
            f"— {remedy(d)}, and restart from a checkpoint from before step {d.onset}.")
    if origin is not None:
        expl += " " + magnitude.sentence(origin, s)
    extra = {"divergence": d.to_json()}
    if origin is not None:
        extra["magnitude_origin"] = origin
    return Diagnosis("training_diverged", "training diverged", expl, [lr_clip_fix(d, s.info)], extra)


def operands(s: Site) -> str:
    """The culprit's inputs, each named for what it is: `fc2.weight` (a parameter) |w| up to 249.9, the
    activation (its mat1) up to 152 — never one number for all of them."""
    parts = []
    names = _arg_names(s)
    for i, st in enumerate(s.inputs):
        v = finite_float(st.get("absmax"))
        if v is None:
            continue
        who = s.leaf(i)
        arg = names[i] if i < len(names) else f"input {i}"
        if who is not None and who[0] == "parameter":
            parts.append(f"the weight {who[1]} ({arg}) |w| up to {v:.4g}")
        elif who is not None:
            parts.append(f"the batch's {who[1]} ({arg}) up to {v:.4g}")
        else:
            parts.append(f"the activation {arg} up to {v:.4g}")
    return "; ".join(parts)


def _arg_names(s: Site) -> list[str]:
    """The culprit op's tensor argument names from its schema (addmm: self, mat1, mat2)."""
    try:
        op = s.rec.op if s.forward and s.rec is not None else None
        return [a.name for a in op._schema.arguments if "Tensor" in str(a.type)] if op is not None else []
    except Exception:  # noqa: BLE001
        return []


def _grown_weights(s: Site, factor: float = 100.0) -> list[tuple[str, float, float]]:
    """(name, max |w|, × its init scale) of weight matrices far beyond the scale an initialisation gives them
    (1 / sqrt(fan_in)): weights that training grew."""
    out = []
    for n, p in s.subject.model.named_parameters():
        if p.is_floating_point() and p.dim() >= 2 and p.numel():
            init = 1 / math.sqrt(max(p[0].numel(), 1))
            v = float(p.detach().abs().max())
            if v > factor * init:
                out.append((n, v, v / init))
    return sorted(out, key=lambda t: -t[2])


@rule("magnitude_overflow", priority=32)
def _magnitude(s: Site) -> Diagnosis | None:
    """A float16 overflow whose step is broken in every dtype: float64 computes it finite, but far outside the
    run's history. A wider dtype only moves the overflow; the cause is the magnitude (weights that grew)."""
    if _low_dtype(s) != "float16" or s.event.role != "origin" or s.event.kind != "inf":
        return None
    ref = plausible.reference(s.info, s.step, s.subject) if plausible.history_rows(s.info) else None
    if ref is None or ref.loss is None or not ref.source.startswith("the recent history"):
        return None
    f64 = plausible.float64_loss(s.subject)
    if f64 is None or f64 <= plausible.LOSS_FACTOR * max(ref.loss, 1e-12):
        return None  # float64 computes what the run expects: a real precision/range problem (fp16_overflow)
    grown = _grown_weights(s)
    if not grown:
        return None  # no weight grew: the values come from the batch (fp16_overflow's normalize-the-input fix)
    origin = magnitude.origin_of(s)
    facts = [f"{n} |w| = {v:.4g} ({k:.0f}× the 1/sqrt(fan_in) scale an initialisation gives it)"
             for n, v, k in grown[:3]]
    what = "the weights grew: " + "; ".join(facts)
    fix = lr_clip_fix(None, s.info)
    fix.alternatives = []  # a dtype change is not offered as a fix here: it was measured not to be one
    expl = (f"{s.event.op} overflowed float16 at {s.where}, but a wider dtype does not help: the same step in "
            f"float64 gives a loss of {f64:.4g}, finite but {f64 / max(ref.loss, 1e-12):.3g}× the largest in "
            f"{ref.source} ({ref.loss:.4g}) — broken in every dtype. Its inputs: {operands(s)}. The cause is the "
            f"magnitude: {what}. A wider dtype (bfloat16, float32) only computes the same huge values without "
            "overflowing; lower the learning rate, clip gradients, and restore a checkpoint from before the "
            "weights grew.")
    extra = {"float64_loss": f64}
    if origin is not None:
        extra["magnitude_origin"] = origin
        expl += " " + magnitude.sentence(origin, s)
    return Diagnosis("magnitude_overflow", "float16 overflow from values that are too large in any dtype", expl,
                     [fix], extra)


@rule("fp16_overflow", priority=30)
def _fp16(s: Site) -> Diagnosis | None:
    low = _low_dtype(s)
    # bfloat16 has float32's range: its overflow is a magnitude problem (rules below), never fixed by bfloat16
    if low != "float16" or s.event.role != "origin" or s.event.kind != "inf":
        return None
    big = max((st.get("absmax") or 0 for st in s.inputs if isinstance(st.get("absmax"), (int, float))), default=0)
    lmax = torch.finfo(torch.float16).max
    auto = s.subject.autocast
    scale = finite_float(s.info.get("grad_scale")) or s.subject.loss_scale
    alternatives = []
    if auto:
        dev = auto.get("device_type", "cuda")
        code = f"with torch.autocast({dev!r}, dtype=torch.bfloat16):  # instead of dtype=torch.float16"
        variant = {"autocast": {**auto, "dtype": torch.bfloat16}, "label": "under bfloat16 autocast"}
        where_run = f"under torch.autocast({dev!r}, dtype=torch.float16)"
        if scale is None and not s.forward:
            alternatives.append(f"keep float16 autocast and scale the loss: scaler = torch.amp.GradScaler({dev!r})")
    else:  # no autocast ran: the float16 is a cast the code made (model.half(), .to(torch.float16))
        held = _half_modules(s)
        code = (f"# no autocast ran: the code casts to float16 itself ({held}). Where it does (.half(), "
                ".to(torch.float16)),\n# cast to torch.bfloat16 instead — the same range as float32 — e.g. "
                "model.to(torch.bfloat16) for model.half()")
        variant = {"dtype": torch.bfloat16, "label": "with the float16 casts made bfloat16"}
        where_run = f"in float16, a cast the code made ({held}; no autocast)"
        if scale is None:
            alternatives.append("keep float32 weights, run the forward under torch.autocast(..., dtype=torch.float16) "
                                "and scale the loss with torch.amp.GradScaler()")
    if s.forward:
        alternatives.append(f"keep float16 and keep the values reaching {s.event.op} in range (a normalisation "
                            "before it, smaller initial weights)")
    have = (f" The run already uses a GradScaler (scale {scale:g}): it cannot help an overflow in forward, and "
            "in backward it only skips steps." if scale is not None else
            " bfloat16 has float32's range; in backward, a GradScaler keeps scaled gradients in range and skips the "
            "step on overflow.")
    fixes = [Fix(FixKind.BF16_OR_GRAD_SCALER, code, variant=variant, alternatives=alternatives,
                 reasoning="bfloat16 trades mantissa bits for float32's exponent range",
                 settings={"autocast_dtype": "bfloat16"} if auto else None)]
    fixes[:0] = [f for f in (upcast.float32_scores(s),) if f is not None]  # the edit that matches the code, first
    raw = _raw_batch_input(s)
    if raw is not None:  # the values that overflow are the batch itself: its range is the cause
        name, absmax = raw
        have = (f" The large values come straight from the batch: `{name}` holds values up to {absmax:.4g}, "
                "so the input's range is the cause — a model expects normalised inputs (roughly unit scale)."
                + have)
        fixes.insert(0, Fix(FixKind.NORMALIZE_INPUT, "", guidance=(
            f"normalise `{name}` in the data pipeline before the model, e.g. x = (x - mean) / std over the dataset, "
            "or divide 8/16-bit image data by 255 / 65535"),
            verification="not replayed: the right normalisation depends on your data; after it, the values "
                         f"reaching {s.event.op} are of order 1",
            reasoning=f"|{name}| up to {absmax:.4g}: float16's largest value is {lmax:.0f}"))
    return Diagnosis("fp16_overflow", "float16 overflow" + (" on un-normalised input" if raw is not None else ""),
                     f"{s.event.op} produced Inf from finite inputs ({operands(s) or f'|x| up to {big:.4g}'}) "
                     f"{where_run}, whose largest "
                     f"value is {lmax:.0f} ({s.where}). The same op is finite in a wider dtype.{have}", fixes)


def _half_modules(s: Site) -> str:
    """Where the model holds float16 weights, in words: "float16 weights in `body`" or "the whole model in float16"."""
    named = [(n, p) for n, p in s.subject.model.named_parameters() if p.is_floating_point()]
    half = [n for n, p in named if p.dtype == torch.float16]
    if not half:
        return "the batch or an activation cast to float16"
    if len(half) == len(named):
        return "the whole model in float16"
    tops = sorted({n.split(".")[0] for n in half})
    return f"float16 weights in {', '.join(f'`{t}`' for t in tops[:3])}{' and more' if len(tops) > 3 else ''}"


def _raw_batch_input(s: Site) -> tuple[str, float] | None:
    """(name, |max|) when the culprit's largest input is a batch tensor (through casts and views) far from unit scale."""
    best = None
    for i, st in enumerate(s.inputs):
        v = finite_float(st.get("absmax"))
        who = s.leaf(i)
        if v is not None and who is not None and who[0] == "input" and v > 100 and (best is None or v > best[1]):
            best = (who[1], v)
    return best


@rule("exploded_weights", priority=20)
def _exploded(s: Site) -> Diagnosis | None:
    """Inf, or NaN from inf − inf inside one op (a matmul, a normalisation), from finite inputs in a
    full-range dtype, with parameters already huge: an earlier step diverged."""
    if s.event.role != "origin":
        return None
    limit = min(1e5, math.sqrt(s.finfo.max) / 16)
    seen = magnitude.culprit_absmax(s)
    if seen < limit:
        return None  # the op never saw a huge value: something else is going on
    huge = _huge_weights(s, limit)
    if not huge:
        return None
    names = ", ".join(f"{n} (max |w| {v:.3g})" for n, v in huge[:3])
    made = "overflowed" if s.event.kind == "inf" else "made NaN (inf − inf inside the op) in"
    return Diagnosis("exploded_weights", "weights already exploded",
                     f"{s.event.op} {made} {s.dtype} (largest value {s.finfo.max:.3g}; its inputs reached "
                     f"{seen:.3g}) at {s.where} because the parameters are already huge: {names}. The step itself is "
                     "not the bug — earlier steps grew the weights. Lower the learning rate, clip gradients, and "
                     "restore the last good checkpoint.",
                     [lr_clip_fix(None, s.info)])


@rule("huge_values", priority=15)
def _huge_values(s: Site) -> Diagnosis | None:
    """Inf/NaN from finite but huge inputs that an op upstream made huge (exp(0.5 * logvar) = 1e37)."""
    if s.event.role != "origin":
        return None
    o = magnitude.origin_of(s)
    if o is None or "op" not in o:
        return None
    src = o.get("source")
    at = f" at {src['file']}:{src['line']}" if src else ""
    what = f"{o['call'] or o['op']}{at}"
    guide = (f"keep the values that reach {what} in range: its input reached {o['input_absmax']:.3g}, "
             f"and it turned that into {o['output_absmax']:.3g}")
    if packet(o["op"]) == "aten.exp":
        guide += "\n(an exp of a log-scale quantity: bound that quantity, or the data that feeds it, before exp)"
    fix = Fix(FixKind.NONE, "", guidance=guide,
              alternatives=["normalise the inputs (e.g. pixels to [0, 1]) so nothing upstream is that large"],
              verification="not replayed: the bound to use depends on what the values mean; nanreplay does not guess "
                           "one")
    return Diagnosis("huge_values", f"{s.event.op} overflowed values made huge upstream",
                     f"{s.event.op} made {s.event.kind.upper()} at {s.where} from finite inputs. "
                     + magnitude.sentence(o, s), [fix], {"magnitude_origin": o})
