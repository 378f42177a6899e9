"""Instrumented replay of one training step (see docs/architecture.md).

    step = replay.run_subject(subject)     # forward, loss, backward under the Recorder

`records` (what is kept), `recorder` (the Recorder and its two thin modes), `frames`
(source lines), `run` (the step), `subject` (what every format rebuilds into).
"""

from __future__ import annotations

from nanreplay.replay.frames import SOURCE_ROOTS, Frame, RecordedFrame, frame_json, user_frame
from nanreplay.replay.recorder import Recorder, call_name
from nanreplay.replay.records import Anomaly, Event, Failure, OpRecord, Step
from nanreplay.replay.run import anomaly_off, autocast_from, grad_norm, outputs_at, run, run_patched, run_subject

__all__ = ["Anomaly", "Event", "Failure", "Frame", "OpRecord", "Recorder", "Step", "anomaly_off", "autocast_from",
           "call_name", "frame_json", "grad_norm", "outputs_at", "RecordedFrame", "run", "run_patched", "SOURCE_ROOTS",
           "run_subject", "user_frame"]
