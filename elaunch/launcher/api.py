"""``elaunch.launcher.api``: ``torch.distributed.launcher.api`` on elaunch's agent.

``LaunchConfig``, ``elastic_launch`` and ``launch_agent`` with torch 2.13's
fields, defaults, signatures, return values and exceptions. The entrypoint is
either

* a program (a ``str``, as torchrun's worker command): each worker runs
  ``[entrypoint, *args]``; the result is ``{global_rank: None}``; or
* a Python function: each worker calls ``entrypoint(*args)`` with its worker
  environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
  ``TORCHELASTIC_*``) already in ``os.environ``; the result is
  ``{global_rank: return value}`` of this node's workers. ``start_method``
  decides how: ``"fork"`` forks the calling process, so the function is not
  pickled (one defined in a notebook or as a closure works); ``"spawn"`` (the
  default) and ``"forkserver"`` pickle the function and its arguments into a
  fresh interpreter (a module-level function; the caller's ``__main__`` is
  re-imported as ``__mp_main__`` as under ``multiprocessing``). elaunch starts
  ``"forkserver"`` workers as ``"spawn"`` ones: a fresh interpreter each.
  Return values must be picklable (as under torch).

Function workers get every guarantee of exec'd ones: their own session, death
with the agent (``PR_SET_PDEATHSIG``, the reaper watchdog for their children),
whole-tree stops, restarts (``max_restarts``), the failure summary, the log
files and ``--tee``/redirects of the ``logs_specs``.

Exceptions are torch's classes or subclasses: ``ValueError`` for a bad
configuration (also a rendezvous backend rejecting its ``rdzv_configs``),
``ChildFailedError`` when the workers failed (a function's exception and
traceback are in its failure's error file, as torch's ``@record`` writes it),
``SignalException`` when a handled signal stopped the job.

Differences from torch (see docs/migrating-from-torchrun.md): ``metrics_cfg``,
``numa_options``, ``duplicate_*_filters`` and ``health_check_server`` are
accepted without effect (a warning names them); ``event_log_handler`` chooses
where a copy of elaunch's event log goes (docs/events.md); a
``LogsSpecs`` other than ``DefaultLogsSpecs`` is used only for its directory,
redirects, tee and rank filter (its ``reify`` is not called).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elaunch.config import OPTIONS
from elaunch.config import LaunchConfig as _RunConfig
from elaunch.config.options import default_of
from elaunch.config.secret import job_secret
from elaunch.config.values import parse_int, parse_nnodes, parse_signals

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]

log = logging.getLogger("elaunch")

#: ``rdzv_configs["timeout"]`` when neither it nor ``rdzv_timeout`` is given (torch: 900 s).
DEFAULT_RDZV_TIMEOUT = 900


@dataclass
class LaunchConfig:
    """How to launch the workers: torch's ``LaunchConfig``, field for field.

    Attributes:
        min_nodes, max_nodes: bounds on the number of nodes, 1 <= min <= max.
        nproc_per_node: workers on this node, >= 1.
        logs_specs: a torch ``LogsSpecs`` (default: a new ``DefaultLogsSpecs()``,
            whose log directory is a fresh temporary one); elaunch uses its
            ``root_log_dir``, redirects, tee and local ranks filter.
        run_id: the job id; "" -> a random one, written back here (as torch).
        role: the workers' role (``ROLE_NAME``), default ``"default_role"``.
        rdzv_endpoint: ``host[:port]`` of the rendezvous.
        rdzv_backend: ``"static"``, ``"c10d"``, ``"etcd"``, ``"etcd-v2"`` or
            ``"etcd-v3"`` (default ``"etcd"``, as torch).
        rdzv_configs: backend options (``--rdzv-conf``); static needs ``rank``.
            ``__post_init__`` sets ``timeout`` (seconds): ``rdzv_timeout`` when
            given, else 900 unless present.
        rdzv_timeout: legacy rendezvous timeout in seconds, -1 for none.
        max_restarts: failed-group restarts before giving up (default 3, as torch).
        monitor_interval: seconds between the agent's checks, > 0.
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"``: how a function
            entrypoint's workers start (a program is always exec'd).
        log_line_prefix_template: console prefix of tee'd lines (``$role_name``,
            ``$rank``, ``$local_rank``), None for ``[<role><local_rank>]:``.
        metrics_cfg: torch metrics configuration; no effect under elaunch.
        local_addr: this node's address as others reach it, None for the FQDN.
        event_log_handler: torch event handler name: ``"null"`` (default) or
            ``"dynamic_rendezvous"`` write ``events.jsonl`` only, ``"console"`` also
            prints each event on stderr, a handler registered in torch's
            ``events.handlers`` table also receives each line; any other name
            raises ValueError when the job starts (docs/events.md).
        numa_options: torch ``NumaOptions``; no effect under elaunch. As torch,
            ``__post_init__`` picks the default ones when CUDA has exactly
            ``nproc_per_node`` devices.
        signals_to_handle: comma-separated signal names that stop the workers and
            raise ``SignalException`` (default ``"SIGTERM,SIGINT,SIGHUP,SIGQUIT"``).
        duplicate_stdout_filters, duplicate_stderr_filters: no effect under elaunch.
        virtual_local_rank: ``LOCAL_RANK=0`` for every worker, each seeing its own device.
        shutdown_timeout: seconds between SIGTERM and SIGKILL when stopping workers;
            None -> ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or 30 (set by ``__post_init__``).

    Raises (``__post_init__``):
        ValueError: a negative ``shutdown_timeout``, or ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
            not an integer (as torch).
        ImportError: torch is not installed (the default ``logs_specs`` is torch's).
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: Any = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = default_of("monitor_interval")
    start_method: str = OPTIONS["start_method"].default
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = OPTIONS["event_log_handler"].default
    numa_options: Any = None
    signals_to_handle: str = OPTIONS["signals_to_handle"].default
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: int | None = None

    def __post_init__(self) -> None:
        # the timeout torch fills in by default: no elaunch backend reads it, so it is
        # not passed on (it would only be named in an "unused key" warning)
        self._default_timeout = self.rdzv_timeout == -1 and "timeout" not in self.rdzv_configs
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = DEFAULT_RDZV_TIMEOUT
        if self.logs_specs is None:
            from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

            self.logs_specs = DefaultLogsSpecs()
        if self.numa_options is None:
            import torch

            if torch.cuda.is_available() and torch.cuda.device_count() == self.nproc_per_node:
                from torch._utils_internal import get_default_numa_options

                self.numa_options = get_default_numa_options()
        if self.shutdown_timeout is None:  # the option's torch variable, read as torch does (an int)
            row = OPTIONS["shutdown_timeout"]
            self.shutdown_timeout = int(os.environ.get(row.env_fallback, f"{row.fallback:g}"))
        elif self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")


class elastic_launch:  # noqa: N801 - torch's name
    """Launch this node's workers of ``entrypoint``; call the object with the entrypoint's args.

    Mirrors ``torch.distributed.launcher.api.elastic_launch``::

        outputs = elastic_launch(config, worker_fn)(foo)     # {global_rank: worker_fn(foo)}
        elastic_launch(config, "/usr/bin/env")("python", "script.py")   # {global_rank: None}

    Args:
        config: the :class:`LaunchConfig`.
        entrypoint: a function (its positional args are the call's) or a program
            (a ``str``, run with the call's args as its argv).
        health_check_server: accepted for torch's signature; not used.

    Calling it returns and raises what :func:`launch_agent` does.
    """

    def __init__(self, config: "LaunchConfig | _RunConfig", entrypoint: Callable | str | None,
                 health_check_server: Any = None) -> None:
        self._config = config
        self._entrypoint = entrypoint
        self._health_check_server = health_check_server

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args),
                            health_check_server=self._health_check_server)


def _entrypoint_name(entrypoint: Callable | str | None, args: list[Any]) -> str:
    """The name torch gives a failed entrypoint: a function's ``__name__``, the program,
    or the script when the program is ``sys.executable``."""
    if callable(entrypoint):
        return getattr(entrypoint, "__name__", repr(entrypoint))
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((a for a in args if isinstance(a, str) and not a.startswith("-")), "")
        return entrypoint
    return ""


def _std(value: Any) -> Any:
    """torch's ``Std`` (or ``{local_rank: Std}``) as elaunch's, by value."""
    from elaunch.procs import Std

    if isinstance(value, dict):
        return {int(k): Std(int(v)) for k, v in value.items()}
    return Std(int(value or 0))


def _program_cmd(entrypoint: str, args: list[Any]) -> tuple[str, ...]:
    """A program's argv: every argument as ``str()`` makes it (a path as ``os.fspath``), as torch's
    ``SubprocessHandler`` does (``elastic_launch(config, "/bin/echo")(1, 2.5)`` runs ``echo 1 2.5``)."""
    return (entrypoint, *(os.fspath(arg) if isinstance(arg, os.PathLike) else str(arg) for arg in args))


def _check(config: LaunchConfig) -> None:
    """Reject what torch's agent would fail on later, with the options' own checks (ValueErrors naming the value)."""
    parse_nnodes((config.min_nodes, config.max_nodes), "min_nodes:max_nodes")
    parse_int(config.nproc_per_node, "nproc_per_node", minimum=1)
    for name in ("max_restarts", "monitor_interval", "start_method"):
        OPTIONS[name].parse(getattr(config, name), name)


def _run_config(config: LaunchConfig | _RunConfig, cmd: tuple[str, ...]) -> _RunConfig:
    """elaunch's own launch configuration for ``config`` running ``cmd``: ``config``'s own, with ``cmd``,
    when it is one already (what ``elaunch.run.config_from_args`` returns, validated when it was built)."""
    if isinstance(config, _RunConfig):
        return dataclasses.replace(config, cmd=cmd)
    _check(config)
    specs = config.logs_specs
    if config.metrics_cfg:
        log.warning("metrics_cfg: accepted for torch compatibility; no effect under elaunch")
    rdzv_configs = {k: v if isinstance(v, str) else str(v) for k, v in config.rdzv_configs.items()
                    if not (k == "timeout" and getattr(config, "_default_timeout", False)
                            and v == DEFAULT_RDZV_TIMEOUT)}
    numa = config.numa_options
    ranks_filter = getattr(specs, "_local_ranks_filter", None)
    return _RunConfig(
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node,
        run_id=config.run_id,
        role=config.role,
        rdzv_backend=config.rdzv_backend,
        rdzv_endpoint=config.rdzv_endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=config.max_restarts,
        monitor_interval=float(config.monitor_interval),
        start_method=config.start_method,
        log_dir=getattr(specs, "root_log_dir", None),
        redirects=_std(getattr(specs, "_redirects", 0)),
        tee=_std(getattr(specs, "_tee", 0)),
        local_ranks_filter=frozenset(ranks_filter) if ranks_filter else None,
        local_addr=config.local_addr,
        shutdown_timeout=float(config.shutdown_timeout or 0),
        signals_to_handle=parse_signals(config.signals_to_handle, "signals_to_handle", allow_empty=True),
        event_log_handler=config.event_log_handler,
        virtual_local_rank=config.virtual_local_rank,
        numa_binding=None if numa is None else str(getattr(getattr(numa, "affinity_mode", None), "value", numa)),
        duplicate_stdout_filters=tuple(config.duplicate_stdout_filters or ()),
        duplicate_stderr_filters=tuple(config.duplicate_stderr_filters or ()),
        log_line_prefix_template=config.log_line_prefix_template,
        cmd=cmd,
        job_secret=job_secret(os.environ),
    )


def _accept(config: "LaunchConfig | _RunConfig", entrypoint: Callable | str | None, health_check_server: Any) -> None:
    """What :func:`launch_agent` checks and sets before it starts, as torch's (its TypeError, run_id, env)."""
    if not (callable(entrypoint) or isinstance(entrypoint, str)):
        raise TypeError(f"entrypoint={entrypoint!r}: expected a function or a program (str)")
    if not config.run_id and not isinstance(config, _RunConfig):  # config_from_args gives every config one
        config.run_id = str(uuid.uuid4().int)
        log.warning("config has no run_id, generated a random run_id: %s", config.run_id)
    if health_check_server is not None:
        log.warning("health_check_server: accepted for torch compatibility; no effect under elaunch")
    signals = config.signals_to_handle
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals if isinstance(signals, str) else ",".join(signals)


def _worker_command(config: "LaunchConfig | _RunConfig", entrypoint: Callable | str, args: list[Any], name: str,
                    results: str) -> tuple[tuple[str, ...], Callable[[int], int] | None]:
    """The workers' argv and, for ``fork``, what each forked worker of local rank ``lr`` runs
    instead: ``entrypoint(*args)``, its value to its result file in ``results``. ``spawn`` and
    ``forkserver`` workers run ``elaunch.procs._fn_worker`` on the function and args pickled there.
    """
    from elaunch.procs import _fn_worker

    if isinstance(entrypoint, str):
        return _program_cmd(entrypoint, args), None
    call = (entrypoint, tuple(args))
    if config.start_method == "fork":  # the argv is not run: each worker is a fork calling the function
        def target(lr: int) -> int:
            return _fn_worker.run_function(lambda: call, _fn_worker.result_path(results, lr))

        return (f"<fork: {name}>",), target
    payload = os.path.join(results, "payload.pkl")
    _fn_worker.write_payload(payload, *call)
    return _fn_worker.worker_cmd(payload, results), None


def _outputs(entrypoint: Callable | str, result: Any, results: str) -> dict[int, Any]:
    """``{global_rank: return value}`` of this node's workers: None each for a program, and
    for a worker that exited 0 without returning (``os._exit(0)``; logged)."""
    from elaunch.procs._fn_worker import read_result, result_path

    if isinstance(entrypoint, str):
        return dict.fromkeys(sorted(result.global_ranks.values()))
    outputs = {}
    for lr, rank in sorted(result.global_ranks.items()):
        try:
            outputs[rank] = read_result(result_path(results, lr))
        except FileNotFoundError:
            log.warning("worker of global rank %d exited 0 without a return value; returning None for it", rank)
            outputs[rank] = None
    return outputs


def launch_agent(config: "LaunchConfig | _RunConfig", entrypoint: Callable | str | None, args: list[Any],
                 health_check_server: Any = None) -> dict[int, Any]:
    """Run this node's workers of ``entrypoint(*args)`` to completion under elaunch's agent.

    Mirrors ``torch.distributed.launcher.api.launch_agent``: an empty
    ``config.run_id`` is replaced by a random one (and logged), and
    ``TORCHELASTIC_SIGNALS_TO_HANDLE`` is set in ``os.environ`` as torch does.

    Args:
        config: the :class:`LaunchConfig`, or what ``elaunch.run.config_from_args`` returns (an
            ``elaunch.config.LaunchConfig``, elaunch's own options included), as torch's ``run``
            hands its ``config_from_args`` result to ``elastic_launch``.
        entrypoint: a function, or a program (``str``) run as ``[entrypoint, *args]``.
        args: the function's positional arguments (picklable for ``spawn`` and
            ``forkserver``), or the program's argv (each made a ``str`` as torch does;
            ``${local_rank}`` is replaced by each worker's local rank, as torch's macro).
        health_check_server: accepted for torch's signature; not used.

    Returns:
        ``{global_rank: return value}`` of this node's workers in the final round
        (``None`` values for a program; return values travel pickled); ``{}``
        when the rendezvous did not need this node.

    Raises:
        ValueError: a bad configuration (names the value), also from a rendezvous
            backend (``elaunch.rendezvous.contract.RendezvousConfigError``).
        TypeError: ``entrypoint`` is neither a function nor a str.
        pickle.PicklingError, AttributeError: ``spawn``/``forkserver`` with a
            function or args that cannot be pickled (use ``start_method="fork"``).
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: the
            workers failed after ``max_restarts`` restarts; ``failures`` by global
            rank (exit code, error file with a function's traceback),
            ``format_msg()`` elaunch's failure summary.
        torch.distributed.elastic.multiprocessing.api.SignalException: a handled
            signal stopped the job (the workers were stopped first).
        elaunch.rendezvous.contract.RendezvousError: the rendezvous failed.
    """
    from elaunch.agent import SignalException
    from elaunch.errors.as_torch import child_failed_error, signal_exception
    from elaunch.launch import run_job
    from elaunch.log import setup_logging

    setup_logging(os.environ)
    _accept(config, entrypoint, health_check_server)
    name = _entrypoint_name(entrypoint, args)
    with tempfile.TemporaryDirectory(prefix="elaunch_fn_") as results:
        cmd, fork_target = _worker_command(config, entrypoint, args, name, results)
        run_config = _run_config(config, cmd)
        log.info("elastic_launch of %s: %s", name or entrypoint, run_config)
        try:
            result = run_job(run_config, fork_target=fork_target)
        except SignalException as exc:
            raise signal_exception(exc) from exc
        if result is None:
            return {}
        if result.is_failed():
            raise child_failed_error(name, result)
        return _outputs(entrypoint, result, results)
