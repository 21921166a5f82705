"""The environment a worker process was started with (stdlib only; imported in workers).

A worker that elaunch forks (a warm spare, a function worker) gets its environment by replacing
``os.environ`` in place, not from an exec, so ``/proc/self/environ`` still shows its parent's: the
fork's bootstrap records what it set, as the attribute :data:`ATTR` of ``sys`` (the warm spare's
bootstrap, ``_warm_child.py``, runs where elaunch itself may not be importable, so it cannot import
this module). ``@elaunch.restartable`` tells from it what the script set in the environment itself
before ``main()``'s first call, and sets that again at each in-process restart.
"""

from __future__ import annotations

import os
import sys

#: The attribute of ``sys`` where a forked worker's bootstrap records the environment it set (``{name: value}``).
ATTR = "_elaunch_launch_env"


def record(env: dict[str, str]) -> None:
    """Record ``env`` as this process's launch environment (a forked worker, before its target runs)."""
    setattr(sys, ATTR, dict(env))


def launch_environ() -> dict[str, str] | None:
    """The environment this process was started with, as ``{name: value}``: what a forked worker's
    bootstrap recorded (:func:`record`), else ``/proc/self/environ`` (the block the kernel gave at exec,
    which later changes of ``os.environ`` leave as it was); None where neither can be had. Decoded as
    ``os.environ`` decodes."""
    recorded = getattr(sys, ATTR, None)
    if recorded is not None:
        return dict(recorded)
    try:
        with open("/proc/self/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    env = {}
    for item in data.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            env[os.fsdecode(name)] = os.fsdecode(value)
    return env
