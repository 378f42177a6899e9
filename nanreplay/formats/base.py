"""What every snapshot format produces, and the small protocol a format implements.

A format is one module in this package with a `Format` object (see `formats/__init__.py`
for the registry and docs/architecture.md for how to add one):

* `sniff(obj)`    does this loaded dict look like mine?
* `parse(path, obj)`   validate it and normalise it into a `Snapshot` (no code runs);
* `rebuild(snap, ...)` the runnable step (`replay.subject.Subject`);
* `describe(snap)`     the format's facts for the report and the JSON's `snapshot_info`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Snapshot:
    """A snapshot, normalised: what to feed the model and what state to load."""

    path: str
    format: str  # the registry name of its format: "native" | "state_dict"
    inputs: Any  # a tensor (model(x)), a tuple/list (model(*x)) or a dict (model(**x))
    target: Any = None
    state: dict[str, torch.Tensor] | None = None
    module: torch.nn.Module | None = None  # a pickled module (only ever with --trust)
    keys: dict[str, str] = field(default_factory=dict)  # which dict keys were used
    raw: dict = field(default_factory=dict)  # everything that was in the file
    step: int | None = None
    rank: int | None = None
    world_size: int | None = None
    trigger: str | None = None  # what made the guard write it: "loss" | "gradient" | "grad_spike"
    history: list[dict] = field(default_factory=list)  # recent steps: {"step", "loss", "grad_norm"}
    created: str | None = None  # ISO time the snapshot was written

    @property
    def name(self) -> str:
        return Path(self.path).name

    def drop_optimizer_state(self) -> int:
        """Let go of the optimizer's per-parameter state (Adam's moments: twice the weights) once nothing will
        read it: only the diagnosis of NaN/Inf weights (the previous update, diagnose/late.py) and an update
        snapshot's replay read it, both before a step's replay begins. Its class and parameter groups stay (the
        report's optimizer and learning rate). Returns the bytes let go."""
        freed = 0
        for rec in (self.raw.get("optimizer"), *self.raw.values()):  # native: {"class", "state_dict", ...}
            sd = rec.get("state_dict") if isinstance(rec, dict) and "state_dict" in rec else rec
            if isinstance(sd, dict) and isinstance(sd.get("state"), dict) and "param_groups" in sd:
                for st in sd["state"].values():
                    for v in (st.values() if isinstance(st, dict) else ()):
                        if isinstance(v, torch.Tensor):
                            freed += v.numel() * v.element_size()
                sd["state"] = {}
        return freed


@dataclass(frozen=True)
class Format:
    name: str  # the value of Snapshot.format and of snapshot_info.format
    title: str  # how people call it: "native snapshot", "plain state-dict snapshot"
    sniff: Callable[[dict], bool]
    parse: Callable[[str, dict], Snapshot]
    rebuild: Callable[..., Any]  # (snap, *, model, loss, device, trust) -> Subject
    describe: Callable[[Snapshot], dict]
