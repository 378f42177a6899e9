"""Fixtures shared by the diagnosis tests."""

from __future__ import annotations

import pytest

import causes
from nanreplay import analysis, formats


@pytest.fixture
def run_case(tmp_path, monkeypatch):
    """Write a case's snapshot and analyze it. `autocast` cases replay under the autocast they ran with;
    `subject` sets more of what a native snapshot would carry (e.g. a GradScaler's `loss_scale`)."""
    def run(name: str, module=causes, subject: dict | None = None, **kw):
        c = module.CASES[name]
        path = c.save(tmp_path / f"{name}_step_3.pt")
        attrs = dict(subject or {})
        if c.expect.get("autocast"):
            attrs["autocast"] = dict(c.expect["autocast"])
        with monkeypatch.context() as m:
            if attrs:
                make = formats.rebuild

                def rebuilt(*a, **k):
                    sub = make(*a, **k)
                    for key, value in attrs.items():
                        setattr(sub, key, value)
                    return sub
                m.setattr(formats, "rebuild", rebuilt)
            res = analysis.analyze(path, model=c.model_spec, loss=c.loss, **kw)
        return res, path
    return run
