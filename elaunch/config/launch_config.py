"""LaunchConfig: everything one ``elaunch`` invocation runs with, validated and resolved (stdlib only).

Mirrors torch's ``torch.distributed.launcher.api.LaunchConfig`` (its field names)
plus the worker argv; ``elaunch.config.build`` makes one from the options. The
defaults are the option table's (``elaunch.config.options``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from elaunch.config.errors import ConfigError
from elaunch.config.options import DEFAULT_FORWARD_SIGNALS, DEFAULT_SHUTDOWN_TIMEOUT, default_of, replicas_for
from elaunch.features.node_check import DEFAULT_SLOW_FACTOR
from elaunch.features.stragglers import StragglerSettings

#: The standalone rendezvous' endpoint: loopback, the port picked at bind time.
STANDALONE_ENDPOINT = "127.0.0.1:0"


@dataclass(frozen=True)
class LaunchConfig:
    """One launch, validated: mirrors torch's ``LaunchConfig`` plus the worker argv.

    Attributes:
        min_nodes, max_nodes: bounds on the number of nodes (``--nnodes``), 1 <= min <= max.
        nproc_per_node: workers on this node, >= 1 (``cpu``/``gpu``/``auto`` resolved).
        run_id: job id (``--rdzv-id``; a fresh uuid4 for standalone).
        role: the workers' role (``--role``).
        rdzv_backend: ``static``, ``c10d``, ``etcd``, ``etcd-v2``, ``etcd-v3`` or the
            internal ``standalone`` (``--standalone``, and single-node static defaults).
        rdzv_endpoint: ``host[:port]`` ("" for none); static: ``master_addr:master_port``;
            standalone: ``127.0.0.1:0`` (port picked at bind time).
        rdzv_configs: ``--rdzv-conf`` entries; static adds ``rank`` = str(``--node-rank``).
        max_restarts: failed-group restarts allowed, >= 0.
        monitor_interval: seconds between agent checks, > 0.
        start_method: ``spawn``, ``fork`` or ``forkserver`` (kept for parity; elaunch
            workers are always separate ``exec``-ed processes).
        log_dir: base directory for worker logs, or None for a temporary one.
        redirects, tee: ``elaunch.procs.std.Std`` or ``{local_rank: Std}`` (``-r``/``-t``).
        local_ranks_filter: local ranks whose output reaches the console, None for all.
        local_addr: this node's address as others reach it, None for the FQDN.
        shutdown_timeout: seconds between SIGTERM and SIGKILL when stopping workers, >= 0.
        inprocess_timeout: seconds a survivor of an in-process restart has to say "ready" after
            the abort before it is killed and its rank replaced (``--inprocess-timeout``, elaunch
            only), > 0.
        signals_to_handle: signal names the agent forwards to workers before stopping
            them and exiting 128 + signum (``"SIGTERM"``, ...).
        forward_signals: signal names the agent forwards to every worker's process
            group while it keeps running (``--forward-signals``, elaunch only); disjoint
            from ``signals_to_handle``. None (the default) is resolved on construction to
            ``("SIGUSR1", "SIGUSR2")`` minus any in ``signals_to_handle`` (``--signals-to-handle
            SIGUSR1`` keeps working as under torchrun).
        hang_timeout: seconds after a worker's last ``elaunch.progress()`` call (once it
            made one) before it counts as hung, stacks dumped, a failure of its rank;
            0.0 is off (``--hang-timeout``, elaunch only), >= 0.
        node_check: ``--node-check`` (elaunch only): check the nodes after each round forms, before
            the workers start (``elaunch.agent.node_check``).
        node_check_slow_factor: the ``--rdzv-conf`` key ``node_check_slow_factor``, a number > 1
            (default 2): a node's check time above this many times the median is slow.
        stragglers: the straggler watch's ``--rdzv-conf`` keys ``straggler_window`` (seconds, 0: off),
            ``straggler_factor``, ``straggler_windows``, ``straggler_exclude`` (elaunch only;
            ``elaunch.features.stragglers.StragglerSettings``).
        metrics_port: the TCP port this agent serves its Prometheus ``/metrics`` on (``--metrics-port``,
            elaunch only), 0-65535 (0: a free port, logged); None: no metrics server.
        event_log_handler: torch event handler name (``--event-log-handler``).
        logs_specs: ``torchrun.logs_specs`` entry-point name, or None for the default.
        virtual_local_rank: set LOCAL_RANK=0 for every worker (``--virtual-local-rank``).
        numa_binding: NUMA affinity mode name, or None.
        duplicate_stdout_filters, duplicate_stderr_filters: substrings selecting lines
            duplicated to a separate file.
        log_line_prefix_template: ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` or None.
        omp_num_threads: 1 when nproc_per_node > 1 and ``OMP_NUM_THREADS`` is unset,
            else None (the workers then inherit the environment's value).
        cmd: the worker argv, e.g. ``("/usr/bin/python3", "-u", "train.py", "--lr=1")``.
        standalone: True when the user asked for ``--standalone``.
        warm_start_modules: ``--warm-start``: modules the spare worker interpreters
            import in advance (``--warm-start-modules``, default ``("torch", "torch._dynamo")``), or
            None when warm start is off (the default; also with ``--no-python``).
        checkpoint_replicas: peer nodes that keep a copy of each node's in-memory snapshots
            (``--checkpoint-replicas``, >= 0; 0 is off); None or ``"auto"``: auto, resolved on
            construction to 1 when ``max_nodes`` > 1, else 0 (``options.replicas_for``). In-memory
            snapshots themselves are always on.
        checkpoint_dir: absolute directory the agent persists snapshots to (``--checkpoint-dir``),
            or None: nothing is persisted.
        checkpoint_persist_interval: seconds between background persists, >= 0; 0: only when a
            worker dies, on a notice and on SIGTERM (``--checkpoint-persist-interval``).
        checkpoint_timeout: seconds, > 0, the agent waits for each fetch from a peer, and on SIGTERM
            for the last persist (``--checkpoint-timeout``).
        checkpoint_exchange_timeout: seconds, > 0, the agent waits for the round's inventory exchange
            (``--checkpoint-exchange-timeout``).
        job_secret: ``ELAUNCH_JOB_SECRET`` (or the file ``ELAUNCH_JOB_SECRET_FILE`` names), bytes, or
            None: the replica services' peers then authenticate with keys published in the rendezvous
            (``config.secret``). Never in the repr.
    """

    min_nodes: int = default_of("nnodes")[0]
    max_nodes: int = default_of("nnodes")[1]
    nproc_per_node: int = default_of("nproc_per_node")
    run_id: str = default_of("rdzv_id")
    role: str = default_of("role")
    rdzv_backend: str = default_of("rdzv_backend")
    rdzv_endpoint: str = ""
    rdzv_configs: dict[str, str] = field(default_factory=dict)
    max_restarts: int = default_of("max_restarts")
    monitor_interval: float = default_of("monitor_interval")
    start_method: str = default_of("start_method")
    log_dir: str | None = None
    redirects: Any = field(default_factory=partial(default_of, "redirects"))
    tee: Any = field(default_factory=partial(default_of, "tee"))
    local_ranks_filter: frozenset[int] | None = None
    local_addr: str | None = None
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    inprocess_timeout: float = default_of("inprocess_timeout")
    signals_to_handle: tuple[str, ...] = default_of("signals_to_handle")
    forward_signals: tuple[str, ...] | None = None
    hang_timeout: float = default_of("hang_timeout")
    node_check: bool = False
    node_check_slow_factor: float = DEFAULT_SLOW_FACTOR
    stragglers: StragglerSettings = StragglerSettings()
    metrics_port: int | None = None
    event_log_handler: str = default_of("event_log_handler")
    logs_specs: str | None = None
    virtual_local_rank: bool = False
    numa_binding: str | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    log_line_prefix_template: str | None = None
    omp_num_threads: int | None = None
    cmd: tuple[str, ...] = ()
    standalone: bool = False
    warm_start_modules: tuple[str, ...] | None = None
    checkpoint_replicas: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_persist_interval: float = default_of("checkpoint_persist_interval")
    checkpoint_timeout: float = default_of("checkpoint_timeout")
    checkpoint_exchange_timeout: float = default_of("checkpoint_exchange_timeout")
    job_secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Resolve ``forward_signals`` against ``signals_to_handle`` (a signal is a stop or a notice, not both),
        and ``checkpoint_replicas``' auto.

        The one place the default of ``--forward-signals`` is resolved (the command,
        ``elaunch.run`` and ``elaunch.launcher`` all make a LaunchConfig).

        Raises:
            ConfigError: an explicit ``forward_signals`` names a signal also in ``signals_to_handle``.
        """
        handle = default_of("signals_to_handle") if self.signals_to_handle is None else tuple(self.signals_to_handle)
        forward = self.forward_signals
        if forward is None:
            forward = tuple(s for s in DEFAULT_FORWARD_SIGNALS if s not in handle)
        for name in forward:
            if name in handle:
                raise ConfigError(
                    f"--forward-signals={','.join(forward)}: {name} is also in --signals-to-handle="
                    f"{','.join(handle)}; a signal either stops the workers or is forwarded as a notice"
                )
        object.__setattr__(self, "signals_to_handle", handle)
        object.__setattr__(self, "forward_signals", tuple(forward))
        # the one place --checkpoint-replicas' auto is resolved: the keeper gets a number
        object.__setattr__(self, "checkpoint_replicas", replicas_for(self.checkpoint_replicas, self.max_nodes))
