"""The error types the CLI turns into one clear line and an exit code.

Anything else that escapes is a bug in nanreplay and keeps its traceback.
"""

from __future__ import annotations


class NanReplayError(Exception):
    """Base class: the message is the whole story, shown as one line."""

    exit_code = 1


class UsageError(NanReplayError):
    """The user asked for something that cannot work (bad file, bad spec, ...)."""

    exit_code = 2


class AnalysisError(NanReplayError):
    """The inputs were fine but the replay itself failed."""

    exit_code = 1


class TrustError(UsageError):
    """The snapshot names code, and the user has not said to run it."""


def first_line(e: BaseException | str, limit: int = 200) -> str:
    """The first line of an exception's message (or any text): what a one-line error can carry."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else ""
