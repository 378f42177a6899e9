"""An eager step (a plain state-dict snapshot rebuilt with `--model`) recorded as a step program before its analysis.

    subject = as_program(subject, snap, max_memory=...)

The guard records the step it saw as a program (capture/program.py); a plain `{'x', 'y', 'state'}` dict carries
none, so `--model` rebuilds the user's module and, until now, every pass ran it eagerly: Python forward on every
replay, no meta dry run, no dead-value freeing, no checkpointed probe. Here the step runs once more under the
same recorder the guard uses (the user's model, loss and batch, grad on, the replay's RNG), and the analysis
goes on with the program exactly as it would for a guard snapshot: decoded from its strict JSON, checked leaf by
leaf, dry-run on meta tensors (shapes and memory bounded), then replayed by `StepModule`.

The report keeps saying what the user ran: `how` (`--model ...`), the model's class, the loss spec, the batch's
labels. A step that cannot be recorded (a custom autograd.Function, reentrant checkpointing, an op off the
allowlist, a forward that raises on a second run) keeps its eager subject, with the reason in `why_eager`.

The model code still runs here once (the recording): it is the code the user named, run as the user, as the
eager path ran it. What confinement can and cannot add to that is in docs/performance.md ("The plain-dict path").
"""

from __future__ import annotations

import torch

from nanreplay.errors import first_line
from nanreplay.formats.base import Snapshot
from nanreplay.replay.subject import Subject, call_model, compute_loss


def as_program(subject: Subject, snap: Snapshot, *, max_memory: int | None) -> tuple[Subject, str | None]:
    """(the step as a program subject, None), or (`subject` unchanged, why it could not be recorded)."""
    if subject.program or subject.autocast or subject.loss_scale:
        return subject, "not an eager float step"
    from nanreplay.capture import owned
    from nanreplay.capture.program import NotRecordable, record_step
    from nanreplay.formats.native import program_subject
    from nanreplay.formats.program import to_json

    model = subject.model
    params = dict(model.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in params.items():
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    # the program's leaves by name: the loaded weights themselves (shared, never written: the recording runs
    # forward only), buffers as they were before the recording's forward (BatchNorm's statistics move in it)
    state = {n: p.detach() for n, p in params.items() if n not in aliases}
    state.update({n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)})
    inputs, target = owned.clone_tensors((subject.inputs, subject.target))  # a forward may write its inputs
    subject.prepare()  # the RNG the eager replay starts from: dropout's masks become the program's constants
    try:
        with torch.enable_grad():
            rec = record_step(lambda: call_model(model, inputs), lambda out: compute_loss(out, target, subject.loss_fn),
                              model=model, batch={"inputs": inputs, "target": target})
    except NotRecordable as e:
        return subject, str(e)
    except Exception as e:  # noqa: BLE001 - the user's step raised (a loss that does not fit the output, ...): the
        # eager replay runs it as before and says so in its own words
        return subject, f"running the step to record it raised {type(e).__name__}: {first_line(e, 300)}"
    program, constants = to_json(rec.program), {k: v.detach() for k, v in rec.constants.items()}
    del rec  # its loss holds the recording's graph
    raw = {"step_program": program, "constants": constants, "batch": {"inputs": None},
           "parameters": [n for n in params if n not in aliases], "aliases": aliases,
           "model_training": model.training, "input_names": subject.input_names}
    recorded = Snapshot(path=snap.path, format=snap.format, inputs=subject.inputs, target=subject.target,
                        state=state, raw=raw)
    common = {"autocast": None, "prepare": subject.prepare, "loss_scale": None}
    out = program_subject(recorded, subject.device, max_memory, common)
    out.how, out.model_class, out.loss_name = subject.how, type(model).__name__, subject.loss_name
    out.input_label, out.target_label, out.input_names = subject.input_label, subject.target_label, subject.input_names
    return out, None
