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
