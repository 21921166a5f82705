"""Process supervision: start workers, watch them, stop whole process trees, route logs.

Public API (no torch import anywhere in this package; the agent imports it):

* :class:`Std`, :func:`std_for`, :func:`to_map` — stream selections (``--redirects``/``--tee``).
* :class:`LogsSpec`, :class:`RunLogDir`, :class:`AttemptLogs`, :func:`line_prefix` — log layout;
  :class:`SpecsLogDir` — the files a torch ``LogsSpecs`` (``--logs-specs``) names instead.
* :class:`WorkerProcesses` — one group's workers: ``start``/``wait``/``poll``/``stop``/``close``.
* :func:`start_reaper`, :class:`Reaper` — the watchdog that kills worker trees if the agent dies.
* :class:`WorkerLauncher` — one agent run's worker starts, log directory, watchdog and warm pool.
"""

from .logs import AttemptLogs, LogsSpec, RunLogDir, SpecsLogDir, line_prefix
from .reaper import Reaper, start_reaper
from .std import Std, std_for, to_map
from .workers import WorkerProcesses
from .launcher import WorkerLauncher

__all__ = [
    "AttemptLogs",
    "LogsSpec",
    "Reaper",
    "RunLogDir",
    "SpecsLogDir",
    "Std",
    "WorkerLauncher",
    "WorkerProcesses",
    "line_prefix",
    "start_reaper",
    "std_for",
    "to_map",
]
