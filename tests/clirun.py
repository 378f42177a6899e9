"""Running `nanreplay` in-process for the CLI tests, and the one check every bad input must pass."""

from __future__ import annotations

import os

from click.testing import CliRunner

from nanreplay.cli import main


def run(*args, cwd=None):
    """`nanreplay ARGS` through click's runner (in `cwd` when given)."""
    runner = CliRunner()
    old = os.getcwd()
    if cwd:
        os.chdir(cwd)
    try:
        return runner.invoke(main, list(map(str, args)))
    finally:
        os.chdir(old)


def one_line_error(res, code: int, *needles: str) -> str:
    """Exit `code`, no traceback, exactly one line on stderr that holds every needle; returns it."""
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err
