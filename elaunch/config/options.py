"""LaunchOptions: the typed, frozen options of one launch, as the command line gives them (stdlib only).

The ``elaunch`` command (``elaunch.cli``) builds one from its parsed flags,
``elaunch.run`` from torchrun's ``argparse.Namespace``, a test or a program
directly. Every value is checked on construction by its flag's parser in
:data:`elaunch.config.values.PARSERS` (text or an already typed value), so an
options object is valid whoever built it; :func:`elaunch.config.build_config`
then only checks what spans several options.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from elaunch.config.launch_config import DEFAULT_SIGNALS, _std_none
from elaunch.config.values import PARSERS

__all__ = ["LaunchOptions"]


def flag_of(name: str) -> str:
    """Return the long flag of option ``name`` (torchrun's ``dest``): ``nproc_per_node`` -> ``--nproc-per-node``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class LaunchOptions:
    """torchrun's options by their argparse ``dest`` names, typed and checked.

    A value of None takes the default; so does ``""`` for a free-text option
    (``rdzv_id``, ``role``, ``master_addr``, ``log_dir``, ...), as an empty
    ``PET_*`` variable counts as unset. Text forms are parsed (``nnodes="1:4"``,
    ``rdzv_conf="a=1"``, ``max_restarts="3"``), typed values checked.

    Attributes:
        training_script: the script, module (``-m``) or program (``--no-python``); None
            is rejected by ``build_config``.
        training_script_args: its arguments.
        nnodes: ``(min, max)`` nodes, 1 <= min <= max (``--nnodes N|MIN:MAX``).
        nproc_per_node: workers per node, an int >= 1 or ``auto``/``cpu``/``gpu``/``xpu``.
        rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf: the rendezvous flags (backend
            names from ``elaunch.rendezvous.registry``; ``rdzv_conf`` a dict).
        standalone: ``--standalone``.
        max_restarts: >= 0. monitor_interval: seconds, > 0. start_method: ``spawn``, ``fork``
            or ``forkserver``. role: the workers' role.
        module, no_python, run_path: how the worker runs the script.
        warm_start, warm_start_modules: ``--warm-start`` and its modules (elaunch only).
        shutdown_timeout: seconds >= 0, None for ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or 30.
        signals_to_handle: signal names (``SIGTERM``, ...). forward_signals: signal names,
            None for the default (``SIGUSR1``, ``SIGUSR2`` minus the handled ones).
        hang_timeout: seconds >= 0, 0 off (elaunch only).
        virtual_local_rank, numa_binding: worker placement.
        log_dir, redirects, tee, local_ranks_filter, duplicate_stdout_filters,
            duplicate_stderr_filters, event_log_handler, logs_specs: logging
            (``redirects``/``tee`` an ``elaunch.procs.std.Std`` or ``{local_rank: Std}``).
        node_rank, master_addr, master_port, local_addr: static rendezvous and this node's
            address (``master_port`` None for 29500, or the standalone rendezvous on one node).
    """

    training_script: str | None = None
    training_script_args: tuple[str, ...] = ()
    nnodes: tuple[int, int] = (1, 1)
    nproc_per_node: int | str = 1
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    warm_start: bool = False
    warm_start_modules: tuple[str, ...] = ("torch",)
    shutdown_timeout: float | None = None
    signals_to_handle: tuple[str, ...] = DEFAULT_SIGNALS
    forward_signals: tuple[str, ...] | None = None
    hang_timeout: float = 0.0
    virtual_local_rank: bool = False
    numa_binding: str | None = None
    log_dir: str | None = None
    redirects: Any = field(default_factory=_std_none)
    tee: Any = field(default_factory=_std_none)
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    event_log_handler: str = "null"
    logs_specs: str | None = None
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None

    def __post_init__(self) -> None:
        """Replace unset values by their defaults and parse or check the rest.

        Raises:
            ConfigError: a value its flag's parser rejects; the message names the flag.
        """
        for f in fields(self):
            value = getattr(self, f.name)
            parse = PARSERS.get(f.name)
            if value is None or (value == "" and parse is None):
                value = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            elif parse is not None:
                value = parse(value, flag_of(f.name))
            elif isinstance(f.default, bool):
                value = bool(value)
            elif f.name == "training_script_args":
                value = tuple(value)
            object.__setattr__(self, f.name, value)

    @classmethod
    def from_namespace(cls, args: Any) -> LaunchOptions:
        """Return the options an ``argparse.Namespace`` (or any object) carries as attributes.

        Mirrors what ``torch.distributed.run.config_from_args`` reads from its ``args``:
        attributes named as torchrun's ``dest``; a missing one takes the default,
        others (``use_env``, ...) are ignored.

        Raises:
            ConfigError: a value its flag's parser rejects.
        """
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
