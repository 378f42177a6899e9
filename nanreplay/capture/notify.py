"""What the guard tells the user, and how a snapshot leaves the machine — never by raising into the training loop.

Imports only the standard library (and, for an object-store folder, nanreplay.remote when a snapshot is uploaded).
"""

from __future__ import annotations

import logging
import os
import warnings

log = logging.getLogger("nanreplay")


def warn_once(warned: set[str], key: str, msg: str) -> None:
    """A warning, once per kind per run; never an exception (also under -W error). It goes to the log too where
    logging is set up (the run's own log keeps it) or where the warning could not be issued (-W error): never
    twice on an unconfigured terminal, where logging's last-resort handler would print it beside the warning."""
    if key in warned:
        return
    warned.add(key)
    issued = False
    try:
        warnings.warn(f"nanreplay: {msg}", RuntimeWarning, stacklevel=5)
        issued = True
    except Exception:  # noqa: BLE001, S110 - warnings turned into errors must not stop training
        pass
    if not issued or log.hasHandlers():
        log.warning("nanreplay: %s", msg)


def upload(path: str, dest: str) -> tuple[str, str | None]:
    """Upload the snapshot at `path` whole into the object-store folder `dest`: (its URL, None), the local copy
    removed; where that fails (the local path, why), the local copy kept."""
    from nanreplay import remote

    try:
        url = remote.upload(path, dest)
    except Exception as e:  # noqa: BLE001 - never crash the training loop
        return path, f"{type(e).__name__}: {e}"
    try:
        os.unlink(path)
    except OSError:
        pass
    return url, None
