"""Process supervision: start workers, watch them, stop whole process trees, route logs.

Public API (no torch import anywhere in this package; the agent imports it):

* :class:`Std`, :func:`std_for`, :func:`to_map` — stream selections (``--redirects``/``--tee``).
* :class:`LogsSpec`, :class:`RunLogDir`, :class:`AttemptLogs`, :func:`line_prefix` — log layout;
  :class:`SpecsLogDir` — the files a torch ``LogsSpecs`` (``--logs-specs``) names instead.
* :class:`WorkerProcesses` — one group's workers: ``start``/``wait``/``poll``/``stop``/``close``.
* :func:`start_reaper`, :class:`Reaper` — the watchdog that kills worker trees if the agent dies.
* :class:`WorkerLauncher` — one agent run's worker starts, log directory, watchdog and warm pool.

Each name is loaded on first access (PEP 562), so importing a submodule alone
(``elaunch.procs.return_barrier`` in every ``--run-path`` and function worker,
``elaunch.procs._fn_worker``) does not load the agent's side: ~30 ms of a worker's start.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~2 ms; checkers accept this
if TYPE_CHECKING:
    from .launcher import WorkerLauncher
    from .logs import AttemptLogs, LogsSpec, RunLogDir, SpecsLogDir, line_prefix
    from .reaper import Reaper, start_reaper
    from .std import Std, std_for, to_map
    from .workers import WorkerProcesses

#: Each public name -> the submodule that defines it.
_HOMES = {
    "AttemptLogs": "logs", "LogsSpec": "logs", "RunLogDir": "logs", "SpecsLogDir": "logs", "line_prefix": "logs",
    "Reaper": "reaper", "start_reaper": "reaper",
    "Std": "std", "std_for": "std", "to_map": "std",
    "WorkerProcesses": "workers",
    "WorkerLauncher": "launcher",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    """Load a public name from its submodule on first access (PEP 562); others are an AttributeError."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the public ones not loaded yet included."""
    return sorted({*globals(), *_HOMES})
