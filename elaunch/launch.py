"""From a validated LaunchConfig to an exit status: the launcher's top level.

Mirrors ``torch.distributed.launcher.api.launch_agent``: build the rendezvous
handler and the WorkerSpec, run the agent, shut the rendezvous down, report.
Exit status: 0 on success, 1 when the workers failed (torchrun's
``ChildFailedError``), 2 for bad input, ``128 + signum`` when a handled signal
stopped the job (torchrun prints a traceback and exits 1 there instead).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from elaunch.agent import ElasticAgent, EnvOptions, SignalException
from elaunch.agent.heap import freeze_startup_heap
from elaunch.config.errors import EXIT_USAGE, ConfigError
from elaunch.config import LaunchConfig
from elaunch.config.logs_specs import make_logs_specs
from elaunch.log import setup_logging
from elaunch.procs import LogsSpec
from elaunch.procs.logs import log_dir_problem
from elaunch.procs.deferral import raise_or_defer
from elaunch.rendezvous.contract import (
    RendezvousConfigError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousParameters,
)
from elaunch.procs.spawn import is_subreaper, stop_being_subreaper
from elaunch.rendezvous.registry import create_handler
from elaunch.spec import RunResult, WorkerSpec
from elaunch.supervision import METRICS, OFF, Supervisor

log = logging.getLogger("elaunch")

EXIT_OK = 0
EXIT_FAILED = 1


class _SignalHandlers:
    """Installs handlers that turn the first handled signal into SignalException.

    Later signals are remembered but do not interrupt the shutdown in progress.
    Signals in ``forward`` (``--forward-signals``) are notices instead: each is
    passed to ``on_notice`` (``ElasticAgent.record_notice``, which only records it
    and wakes the agent's loop; the loop forwards it) and the job keeps running.
    A handler only records or raises (torch's ``_terminate_process_handler`` raises
    ``SignalException`` too): what a signal leads to runs in the agent's main loop.
    """

    def __init__(self, names: tuple[str, ...], forward: tuple[str, ...] = (),
                 on_notice: Callable[[int], None] | None = None) -> None:
        self._names = names
        self._forward = forward
        self._on_notice = on_notice
        self._previous: dict[int, object] = {}
        self._received: int | None = None

    def _notice(self, signum: int, frame) -> None:
        if self._received is None and self._on_notice is not None:
            self._on_notice(signum)  # records only (a queue and a self-pipe write)

    def _handle(self, signum: int, frame) -> None:
        if self._received is not None:
            return
        self._received = signum
        raise_or_defer(SignalException(signum))

    def __enter__(self) -> "_SignalHandlers":
        if threading.current_thread() is not threading.main_thread():
            # Python lets only the main thread set handlers; torch's agent then installs none either
            # (a launch from a notebook's, a server's or a test harness's thread runs without them)
            log.debug("launched from thread %s, not the main one: no signal handlers", threading.current_thread().name)
            return self
        for name in self._names:
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._handle)
        for name in self._forward:
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._notice)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def build_spec(config: LaunchConfig) -> WorkerSpec:
    """Return the WorkerSpec a LaunchConfig describes."""
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        cmd=tuple(config.cmd),
        local_addr=config.local_addr,
    )


def entrypoint_name(cmd: tuple[str, ...]) -> str:
    """Return the script or module a worker argv runs, for messages (``train.py``)."""
    rest = list(cmd)
    if rest and (rest[0] == sys.executable or os.path.basename(rest[0]).startswith("python")):
        rest.pop(0)
        while rest and rest[0] in ("-u", "-m", "elaunch.runpath"):
            rest.pop(0)
    return os.path.basename(rest[0]) if rest else "worker"


#: ``--rdzv-conf`` keys the agent reads itself (``LaunchConfig`` fields), not the rendezvous backend:
#: they are not passed on, so no backend warns that it ignores them.
AGENT_RDZV_KEYS = frozenset({"node_check_slow_factor", "straggler_window", "straggler_factor", "straggler_windows",
                             "straggler_exclude"})


def rendezvous_parameters(config: LaunchConfig) -> RendezvousParameters:
    """Return the RendezvousParameters a LaunchConfig describes (without :data:`AGENT_RDZV_KEYS`)."""
    return RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        config={k: v for k, v in config.rdzv_configs.items() if k not in AGENT_RDZV_KEYS},
        local_addr=config.local_addr,
        role=config.role,
        local_world_size=config.nproc_per_node,
    )


def _unimplemented(config: LaunchConfig) -> list[tuple[str, str]]:
    """The torchrun flags given a non-default value that elaunch parses but does not act on."""
    given = [
        ("--numa-binding", config.numa_binding),
        ("--duplicate-stdout-filters", ",".join(config.duplicate_stdout_filters)),
        ("--duplicate-stderr-filters", ",".join(config.duplicate_stderr_filters)),
    ]
    return [(flag, value) for flag, value in given if value]


def run_job(config: LaunchConfig, fork_target: Callable[[int], int] | None = None,
            own_process: bool = False) -> RunResult | None:
    """Run the job a LaunchConfig describes on this node; return its RunResult.

    Mirrors ``torch.distributed.launcher.api.launch_agent`` minus the exception it
    builds from a failed result: the caller decides (``launch`` prints the summary
    and returns 1, ``elaunch.run.run`` raises torch's ``ChildFailedError``).

    Args:
        config: the launch.
        fork_target: ``elaunch.launcher`` with a function and ``start_method="fork"``:
            each worker is a fork of this process calling ``fork_target(local_rank)``
            (``config.cmd`` is not run); None: workers exec ``config.cmd``.
        own_process: this process is the agent alone (the ``elaunch`` command): its
            start-up heap is frozen out of garbage collection before the first
            rendezvous (``elaunch.agent.heap``). False for the Python API, which
            runs in the caller's process: there the child-subreaper flag the agent sets
            while workers run is cleared again when this returns (unless the caller had set it).

    Returns:
        The agent's RunResult (``is_failed()`` tells a failed job), or None when the
        rendezvous said this node is not needed (torch's graceful exit).

    Raises:
        ConfigError: ``--logs-specs`` names an entry point that fails to load (a ValueError),
            ``--log-dir`` is unusable (a file, or a directory that cannot be created or written
            in), or ``--metrics-port`` cannot be bound (checked before the rendezvous or any
            process starts).
        RendezvousConfigError: a backend rejected its configuration (a ValueError).
        RendezvousError: the rendezvous failed.
        SignalException: a handled signal (``--signals-to-handle``) stopped the job;
            the workers are stopped and this node left the rendezvous.
    """
    setup_logging(os.environ)
    # the workers' environment: snapshot it before a backend adjusts the agent's own
    # (torchrun exports TORCHELASTIC_SIGNALS_TO_HANDLE to every worker too)
    base_env = dict(os.environ, TORCHELASTIC_SIGNALS_TO_HANDLE=",".join(config.signals_to_handle))
    # torchrun instantiates its LogsSpecs before the rendezvous too
    specs = make_logs_specs(config.logs_specs, config.log_dir, config.redirects, config.tee,
                            config.local_ranks_filter)
    if specs is None:  # elaunch's layout: an unusable --log-dir is bad input, found before any process starts
        problem = log_dir_problem(config.log_dir)
        if problem is not None:
            raise ConfigError(f"--log-dir={config.log_dir}: {problem}")
    _warn_about(config)  # after the checks above: bad input is one line
    # the launch's one supervisor: the metrics server and the rendezvous' threads from now on, the
    # run's helpers and reaper once the agent runs (elaunch.supervision); closed last
    supervisor = Supervisor()
    metrics = None
    if config.metrics_port is not None:  # the module imports prometheus_client: only when asked
        from elaunch.agent.metrics import MetricsPortError, start_metrics

        try:
            metrics = start_metrics(config)  # a port that cannot be bound is bad input: nothing else started yet
        except MetricsPortError as exc:
            raise ConfigError(str(exc)) from None
        supervisor.add(metrics, METRICS, on_death=OFF, wakes=False, note="/metrics is not served any more")
    was_subreaper = is_subreaper()
    try:
        return _run_agent(config, specs, base_env, fork_target, own_process, metrics, supervisor)
    finally:
        supervisor.close()  # what the run left (the rendezvous' threads), then the metrics port
        if not was_subreaper and not own_process:  # the API: the caller's later orphans go to init again
            stop_being_subreaper()


def _run_agent(config: LaunchConfig, specs, base_env: dict[str, str], fork_target: Callable[[int], int] | None,
               own_process: bool, metrics, supervisor: Supervisor) -> RunResult | None:
    """:func:`run_job` from the rendezvous handler on (arguments as it has them; ``metrics``: serving, or None;
    ``supervisor``: the launch's)."""
    handler = create_handler(rendezvous_parameters(config), store_in_background=True, supervisor=supervisor)
    agent = _build_agent(config, handler, specs, base_env, fork_target, metrics, supervisor)
    if own_process:
        freeze_startup_heap()
    try:
        with _SignalHandlers(config.signals_to_handle, config.forward_signals, agent.record_notice):
            try:
                result = agent.run()
            except SignalException:
                # a node that leaves: the others re-form without it (they may still meet MIN nodes)
                handler.leave()
                raise
            except BaseException:
                handler.shutdown()
                raise
            handler.shutdown()
    except RendezvousGracefulExitError as exc:
        log.warning("this node is not needed: %s", exc)
        return None
    return result


def _warn_about(config: LaunchConfig) -> None:
    """Log torchrun's warnings: flags accepted without effect, and the OMP_NUM_THREADS default."""
    for flag, value in _unimplemented(config):
        log.warning("%s=%s is accepted for torchrun compatibility but has no effect in this version of elaunch",
                    flag, value)
    if config.omp_num_threads is not None and "OMP_NUM_THREADS" not in os.environ:
        log.warning(
            "Setting OMP_NUM_THREADS=%d for each worker to avoid overloading the system; "
            "tune it for your application.",
            config.omp_num_threads,
        )


def _build_agent(config: LaunchConfig, handler, specs, base_env: dict[str, str],
                 fork_target: Callable[[int], int] | None, metrics=None, supervisor=None) -> ElasticAgent:
    """The node's ElasticAgent for ``config`` (arguments as :func:`run_job` has them)."""
    return ElasticAgent(
        build_spec(config),
        handler,
        LogsSpec(
            log_dir=config.log_dir,
            redirects=config.redirects,
            tee=config.tee,
            local_ranks_filter=config.local_ranks_filter,
            line_prefix_template=config.log_line_prefix_template,
            specs=specs,
        ),
        EnvOptions(
            run_id=config.run_id,
            max_restarts=config.max_restarts,
            use_agent_store=False,
            omp_num_threads=config.omp_num_threads,
            virtual_local_rank=config.virtual_local_rank,
        ),
        config,
        base_env=base_env,
        fork_target=fork_target,
        metrics=metrics,
        supervisor=supervisor,
    )


def launch(config: LaunchConfig) -> int:
    """Run the job a LaunchConfig describes on this node; return the exit status.

    Never raises for an expected failure: rendezvous errors and worker failures are
    reported on stderr (one line, or the failure summary) and mapped to a status:
    0 success, 1 failed workers or rendezvous, 2 a rendezvous configuration
    error, ``128 + signum`` after a handled signal.
    """
    try:
        result = run_job(config, own_process=True)
    except SignalException as exc:
        record_launcher_error(exc)
        return 128 + exc.sigval
    except RendezvousConfigError as exc:
        print(f"elaunch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RendezvousError as exc:
        print(f"elaunch: rendezvous failed: {exc}", file=sys.stderr)
        record_launcher_error(exc)
        return EXIT_FAILED
    if result is not None and result.is_failed():
        from elaunch.errors import format_failure_summary  # only on failure: keeps start-up light

        title = f"{entrypoint_name(config.cmd)} FAILED"
        print(format_failure_summary(result.failures, title=title, first=result.root_rank), file=sys.stderr)
        record_launcher_error(result)
        return EXIT_FAILED
    return EXIT_OK


def record_launcher_error(failed: RunResult | BaseException) -> None:
    """Write the launcher's own failure to its ``TORCHELASTIC_ERROR_FILE``, when it has one.

    torchrun's ``main`` is decorated with torch's ``@record``: a launcher that runs
    as another agent's worker (its environment has the variable) hands the root
    cause up. For failed workers, the root cause's error file is copied, with its
    exit code as ``errorCode`` (nothing is written when that worker wrote no file,
    as torch's); for any other failure (a handled signal too: ``SignalException:
    Process <pid> got signal: <signum>``, torch's message), the exception is written. Nothing happens without the
    variable. Never raises (a write error is a warning).

    Args:
        failed: the failed job's RunResult, or the exception that ended the launch
            (``SignalException`` for a handled signal).
    """
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from elaunch.errors import ErrorHandler, root_cause

    handler = ErrorHandler()
    if isinstance(failed, BaseException):
        handler.record_exception(failed)
        return
    root = failed.failures.get(failed.root_rank) if failed.root_rank is not None else None
    root = root or (root_cause(failed.failures) if failed.failures else None)
    if root is not None and root.error_file and os.path.isfile(root.error_file):
        handler.dump_error_file(root.error_file, root.exitcode)
