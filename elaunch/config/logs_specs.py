"""``--logs-specs NAME``: torchrun's ``torchrun.logs_specs`` entry points (mirrors ``run._get_logs_specs_class``).

A package registers a torch ``LogsSpecs`` subclass under a name::

    [project.entry-points."torchrun.logs_specs"]
    flat = "my_pkg.logs:FlatLogsSpecs"

torch itself registers ``default`` (its ``DefaultLogsSpecs``). elaunch reads the
entry points only when ``--logs-specs`` is given. ``default`` (any entry point
whose object is torch's ``DefaultLogsSpecs``) keeps elaunch's own layout, which is
that class's, without importing torch; another class is loaded and instantiated
as torchrun does (``cls(log_dir=, redirects=, tee=, local_ranks_filter=)``) and
its ``reify`` names the workers' files (``elaunch.procs.logs.SpecsLogDir``).
Stdlib only until a class is loaded.
"""

from __future__ import annotations

from typing import Any

from elaunch.config.errors import ConfigError

#: torch's entry-point group of ``LogsSpecs`` classes.
LOGS_SPECS_GROUP = "torchrun.logs_specs"
#: The object of torch's own ``default`` entry point.
TORCH_DEFAULT_LOGS_SPECS = "torch.distributed.elastic.multiprocessing:DefaultLogsSpecs"


def find_logs_specs(name: str, label: str = "--logs-specs") -> Any:
    """Return the ``torchrun.logs_specs`` entry point called ``name`` (not loaded).

    Raises:
        ConfigError: no such entry point (a ValueError, as torch's); the message
            names the value and the installed names.
    """
    from importlib.metadata import entry_points

    group = entry_points(group=LOGS_SPECS_GROUP)
    found = next(iter(group.select(name=name)), None)
    if found is None:
        installed = ", ".join(sorted({ep.name for ep in group})) or "none"
        raise ConfigError(f"{label}={name}: no '{LOGS_SPECS_GROUP}' entry point of that name (installed: {installed})")
    return found


def logs_specs_class(name: str | None) -> type | None:
    """Return the ``LogsSpecs`` class ``--logs-specs=name`` selects, or None for elaunch's own layout.

    None for no name and for torch's ``DefaultLogsSpecs`` (whose layout elaunch's is).

    Raises:
        ConfigError: no entry point of that name, or it fails to load (the message
            names the entry point and the error).
    """
    if name is None:
        return None
    entry_point = find_logs_specs(name)
    if entry_point.value.replace(" ", "") == TORCH_DEFAULT_LOGS_SPECS:
        return None
    try:
        cls = entry_point.load()
    except Exception as exc:  # a broken plugin: one line naming it
        raise ConfigError(f"--logs-specs={name}: the entry point {entry_point.value} failed to load: "
                          f"{type(exc).__name__}: {exc}") from exc
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    return None if cls is DefaultLogsSpecs else cls


def make_logs_specs(name: str | None, log_dir: str | None, redirects: Any, tee: Any,
                    local_ranks_filter: frozenset[int] | None) -> Any:
    """Instantiate the ``LogsSpecs`` ``--logs-specs=name`` selects, as torchrun does; None for elaunch's layout.

    Args:
        name: the entry-point name or None.
        log_dir: ``--log-dir`` or None; redirects, tee: elaunch ``Std`` or local rank -> ``Std``
            (passed as torch's ``Std``); local_ranks_filter: ``--local-ranks-filter`` or None.

    Raises:
        ConfigError: see :func:`logs_specs_class`.
        Exception: whatever the class's constructor raises (torch's default raises
            NotADirectoryError for a ``log_dir`` that is a file).
    """
    cls = logs_specs_class(name)
    if cls is None:
        return None
    from torch.distributed.elastic.multiprocessing import Std

    def torch_std(value: Any) -> Any:
        if isinstance(value, dict):
            return {int(lr): Std(int(std)) for lr, std in value.items()}
        return Std(int(value))

    return cls(log_dir=log_dir, redirects=torch_std(redirects), tee=torch_std(tee),
               local_ranks_filter=set(local_ranks_filter) if local_ranks_filter else None)
