"""``elaunch status ...`` and ``elaunch timeline ...`` beside torchrun's positional script.

torchrun takes its first positional argument as the training script, so
``torchrun status`` runs a Python file named ``status`` in the working directory
(and fails when there is none). elaunch keeps that: the first argument names a
subcommand only when it is one of :data:`SUBCOMMANDS` *and* no file or directory
of that name exists in the working directory. ``elaunch ./status`` (or any path
with a slash) always runs the script; ``python -m elaunch.<module>`` always runs
the subcommand. No torchrun invocation that works changes meaning. Stdlib only.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence

#: Subcommand name -> "module:function"; the function takes the remaining argv and returns an exit status.
SUBCOMMANDS: dict[str, str] = {
    "status": "elaunch.status:main",
    "timeline": "elaunch.timeline:main",
}


def pick(argv: Sequence[str]) -> Callable[[list[str]], int] | None:
    """Return the subcommand ``argv`` (without the program name) asks for, or None (a launch).

    Imports the subcommand's module only when it is chosen.
    """
    if not argv or argv[0] not in SUBCOMMANDS or os.path.exists(argv[0]):
        return None
    module, _, function = SUBCOMMANDS[argv[0]].partition(":")
    return getattr(importlib.import_module(module), function)
