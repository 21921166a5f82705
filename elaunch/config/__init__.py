"""One launch's configuration: from the typed options to the validated LaunchConfig (stdlib only).

``build_config(LaunchOptions(...), environ) -> LaunchConfig``; the modules:


* ``errors``: ConfigError (bad user input) and its exit status, EXIT_USAGE;
* ``options``: the option table (one row per option: spellings, ``PET_*`` variable,
  parser, default, help, group, torch field) and LaunchOptions, the typed, frozen
  options derived from it (from the CLI, ``elaunch.run`` or a caller);
* ``values``: the flags' value parsers;
* ``launch_config``: LaunchConfig, the frozen result;
* ``build``: build_config, the options resolved (torch ``config_from_args``);
* ``nproc``: ``--nproc-per-node`` to a worker count;
* ``logs_specs``: ``--logs-specs``, torchrun's ``torchrun.logs_specs`` entry points;
* ``worker_cmd``: the worker argv (python ``-u``, ``-m``, ``--no-python``, ``--run-path``).
"""

from elaunch.config.errors import EXIT_USAGE, ConfigError
from elaunch.config.options import (
    DEFAULT_FORWARD_SIGNALS,
    DEFAULT_SIGNALS,
    NUMA_MODES,
    OPTIONS,
    START_METHODS,
    LaunchOptions,
)
from elaunch.config.launch_config import LaunchConfig
from elaunch.config.build import build_config
from elaunch.config.nproc import resolve_nproc
from elaunch.config.worker_cmd import build_cmd

__all__ = [
    "DEFAULT_FORWARD_SIGNALS",
    "DEFAULT_SIGNALS",
    "EXIT_USAGE",
    "NUMA_MODES",
    "OPTIONS",
    "START_METHODS",
    "ConfigError",
    "LaunchConfig",
    "LaunchOptions",
    "build_cmd",
    "build_config",
    "resolve_nproc",
]
