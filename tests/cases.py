"""The case machinery shared by the fixture modules (`nanmodels.py`, `causes.py`).

A case is a zero-argument model factory in a fixture module (what `--model MODULE:FACTORY` names), a
batch, an optional loss spec, and `expect`: what the analysis must find. Each fixture module fills its
own `Registry` with its `case` decorator:

    CASES = Registry(__name__)
    case = CASES.case

    @case("log_zero", batch, phase="forward", kind="inf")
    @seeded
    def log_likelihood(): ...

The line that should be blamed carries a `# CULPRIT: <marker>` comment; `CASES.marker_line(marker)` finds
it in the fixture module's own file, so an expectation never drifts from the code.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Case:
    name: str
    module: str  # the fixture module the factory lives in
    factory: str  # a zero-argument function of that module
    batch: Callable[[], dict]
    loss: str | None = None
    expect: dict = field(default_factory=dict)  # culprit JSON keys to check, 'verdict', 'anomaly', 'cause', 'fix', ...

    @property
    def model_spec(self) -> str:
        """What `--model` names: `MODULE:FACTORY`, exactly as a user would write it."""
        return f"{self.module}:{self.factory}"

    def build(self) -> torch.nn.Module:
        return getattr(importlib.import_module(self.module), self.factory)()

    def save(self, path: Path) -> Path:
        """Write the case as a plain state-dict snapshot: {'x': ..., 'y': ..., 'state': model.state_dict()}."""
        d = dict(self.batch())
        d["state"] = self.build().state_dict()
        torch.save(d, path)
        return path

    def native_snapshot(self, folder: Path, **guard_kw) -> Path:
        """Run the case's step once under NanGuard, as the README shows, and return the snapshot it wrote."""
        import warnings

        from nanreplay import NanGuard
        from nanreplay.formats.usercode import resolve_loss
        from nanreplay.replay.subject import call_model, compute_loss

        model = self.build()
        loss_fn = resolve_loss(self.loss) if self.loss else None
        guard = NanGuard(model, loss_fn=loss_fn, folder=folder, **guard_kw)
        b = self.batch()
        guard.begin(b["x"], b.get("y"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = compute_loss(call_model(model, b["x"]), b.get("y"), loss_fn)
            if guard.loss_ok(loss):
                loss.backward()
                assert not guard.grads_ok(), f"{self.name}: the step did not go non-finite"
        assert guard.last_snapshot, guard.last_error
        return Path(guard.last_snapshot)


class Registry(dict[str, Case]):
    """The cases of one fixture module, by name, in the order they are defined."""

    def __init__(self, module: str):
        super().__init__()
        self.module = module

    def case(self, name: str, batch: Callable[[], dict], loss: str | None = None, **expect):
        """Register the decorated factory as case `name`; `expect` is what its analysis must find."""
        def deco(factory):
            self[name] = Case(name, self.module, factory.__name__, batch, loss, expect)
            return factory
        return deco

    def marker_line(self, marker: str) -> int:
        """The line of `# CULPRIT: <marker>` in this fixture module's file."""
        return marker_line(marker, Path(sys.modules[self.module].__file__))


def marker_line(marker: str, path: Path) -> int:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# CULPRIT: {marker}"):
            return i
    raise KeyError(marker)


def seeded(fn):
    """A factory that builds its model right after `torch.manual_seed(0)`: the same weights every time."""
    def wrapper():
        torch.manual_seed(0)
        return fn()
    wrapper.__name__ = fn.__name__
    return wrapper
