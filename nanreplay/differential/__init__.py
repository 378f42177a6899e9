"""Differential replays: a hypothesis the analysis would otherwise only advise on, tested by replaying.

Each module answers one question, runs only when that question arises (never on a plain culprit), is bounded
by the analysis's `--timeout`/`--max-memory` like every other pass, and is skipped with a one-line reason when
torch cannot do it here. Each returns a plain dict that lands in `Analysis.differential[<name>]`:

    {"question": str,            # what was asked, in words
     "ran": [ {what, where, loss, loss_finite, grads_finite, ...}, ... ],   # every replay it made: its evidence
     "verdict": str,             # a closed vocabulary per module
     "sentence": str,            # the verdict in one sentence, written from `ran`
     "skipped": str | None,      # why it did not run here, if it did not
     "seconds": float}

* `compiler.py` — a `torch.compile`d step whose eager replay is finite: compiled vs eager, bisected by segment.
* `kernel.py`   — a fused / backend-specific culprit: the node alone vs its reference composition.
* `machine.py`  — the guard's in-process re-run vs the training step: transient (hardware) evidence.
"""
