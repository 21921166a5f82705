"""The launcher's own log output: ``[elaunch] LEVEL message`` on stderr."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping


def setup_logging(environ: Mapping[str, str]) -> None:
    """Send the ``elaunch`` loggers to stderr at ``$LOGLEVEL`` (default WARNING), as torchrun.

    Idempotent: a second call only updates the level. An unknown level name means WARNING.
    """
    root = logging.getLogger("elaunch")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[elaunch] %(levelname)s %(message)s"))
        root.addHandler(handler)
        root.propagate = False
    level = logging.getLevelName(str(environ.get("LOGLEVEL", "WARNING")).upper())
    root.setLevel(level if isinstance(level, int) else logging.WARNING)


def fast_exit(status: int) -> None:
    """Flush the log and the standard streams, then ``os._exit(status)``.

    For commands run as programs once torch was loaded: the interpreter's teardown
    of torch takes about 0.3 s (seconds under load) and nothing is left to do.
    """
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
