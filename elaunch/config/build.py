"""build_config: the typed options of one ``elaunch`` invocation resolved into a LaunchConfig.

Stdlib only: torch is imported lazily, and only by ``elaunch.config.nproc`` when
``--nproc-per-node`` is ``gpu``, ``xpu`` or ``auto``. This is the one place where
the launcher reads the environment (``OMP_NUM_THREADS``, ``PYTHON_EXEC``,
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``,
``PATH``); the mapping is passed in explicitly so tests need no monkeypatching.

Mirrors ``torch.distributed.run.config_from_args`` and ``run`` (standalone and
single-node static rewriting, static endpoint defaults, worker argv).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

from elaunch.config.errors import ConfigError
from elaunch.config.launch_config import (
    DEFAULT_FORWARD_SIGNALS,
    DEFAULT_MASTER_PORT,
    DEFAULT_SHUTDOWN_TIMEOUT,
    DEFAULT_SIGNALS,
    START_METHODS,
    STANDALONE_ENDPOINT,
    LaunchConfig,
    _std_none,
)
from elaunch.config.nproc import resolve_nproc
from elaunch.config.worker_cmd import build_cmd, warm_start_modules
from elaunch.rendezvous.api import RendezvousConfigError
from elaunch.rendezvous.endpoint import parse_endpoint, parse_endpoints
from elaunch.rendezvous.registry import ENDPOINT_LIST_BACKENDS, STANDALONE_BACKEND, user_backend_names

__all__ = ["build_config"]

logger = logging.getLogger("elaunch.config")


def _check_endpoint(backend: str, endpoint: str, label: str = "--rdzv-endpoint") -> tuple[str, int | None]:
    """Check ``endpoint`` as the command line needs it (brackets around IPv6, port 1-65535).

    Returns:
        The first ``(host, port)`` (an etcd backend takes a comma-separated list).

    Raises:
        ConfigError: the endpoint, or one entry of an etcd list, is malformed.
    """
    try:
        if backend in ENDPOINT_LIST_BACKENDS:
            return parse_endpoints(endpoint, label=label)[0]
        if not endpoint.strip():
            raise ConfigError(f"{label}={endpoint}: empty endpoint in the list")
        return parse_endpoint(endpoint, label=label)
    except RendezvousConfigError as exc:
        raise ConfigError(str(exc)) from None


def _env_shutdown_timeout(environ: Mapping[str, str]) -> float:
    raw = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if raw is None or raw.strip() == "":
        return DEFAULT_SHUTDOWN_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw}: expected seconds (a number)") from None
    if not value >= 0:
        raise ConfigError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw}: must be >= 0 seconds")
    return value


def _signal_sets(
    handle: tuple[str, ...] | None, forward: tuple[str, ...] | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Resolve ``(signals_to_handle, forward_signals)``; a signal is a stop or a notice, not both.

    Args:
        handle: ``--signals-to-handle`` names, None for the default.
        forward: ``--forward-signals`` names, None when not given: then the default
            leaves out what ``handle`` names (``--signals-to-handle SIGUSR1`` keeps
            working as under torchrun).

    Raises:
        ConfigError: an explicit ``--forward-signals`` names a signal also handled.
    """
    handle = tuple(handle or DEFAULT_SIGNALS)
    if forward is None:
        return handle, tuple(s for s in DEFAULT_FORWARD_SIGNALS if s not in handle)
    for name in forward:
        if name in handle:
            raise ConfigError(
                f"--forward-signals={','.join(forward)}: {name} is also in --signals-to-handle="
                f"{','.join(handle)}; a signal either stops the workers or is forwarded as a notice"
            )
    return handle, tuple(forward)


def build_config(options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Resolve parsed options into a LaunchConfig (torch ``run`` + ``config_from_args``).

    Args:
        options: typed values keyed by torchrun's argparse ``dest`` names, as the
            click ParamTypes in ``elaunch.cli.params`` produce them: ``nnodes``
            ``(min, max)``, ``nproc_per_node`` int or keyword, ``rdzv_conf`` dict,
            ``redirects``/``tee`` Std values, ``local_ranks_filter`` frozenset or None,
            ``signals_to_handle`` tuple, ``forward_signals`` tuple or None (default),
            ``shutdown_timeout`` float or None, ``hang_timeout`` float (seconds),
            ``training_script`` str, ``training_script_args`` tuple, flags as bools.
            Missing keys take torchrun's defaults.
        environ: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: a value, or a combination, is invalid; the message names it.
    """
    env = os.environ if environ is None else environ
    notes: list[str] = []  # warnings, logged only once everything validated
    o = dict(options)
    get = o.get
    min_nodes, max_nodes = get("nnodes") or (1, 1)
    if not 0 < min_nodes <= max_nodes:
        raise ConfigError(f"--nnodes={min_nodes}:{max_nodes}: need 1 <= MIN <= MAX")
    script = get("training_script")
    if not script:
        raise ConfigError("missing the training script (elaunch [OPTIONS] SCRIPT [ARGS]...)")

    backend = get("rdzv_backend") or "static"
    endpoint = get("rdzv_endpoint") or ""
    run_id = get("rdzv_id") or "none"
    master_port = get("master_port")
    master_addr = get("master_addr") or "127.0.0.1"
    node_rank = get("node_rank") or 0
    standalone = bool(get("standalone"))
    if backend not in user_backend_names():
        raise ConfigError(f"--rdzv-backend={backend}: unknown backend (known: {', '.join(user_backend_names())})")
    if endpoint:
        _check_endpoint(backend, endpoint)

    if standalone:
        if max_nodes != 1:
            raise ConfigError(f"--nnodes={min_nodes}:{max_nodes}: --standalone runs a single node")
        if (backend, endpoint, run_id) != ("static", "", "none"):
            notes.append("--standalone: ignoring the given --rdzv-backend/--rdzv-endpoint/--rdzv-id")
        backend, endpoint, run_id = STANDALONE_BACKEND, STANDALONE_ENDPOINT, str(uuid.uuid4())
    elif backend == "static" and not endpoint and master_port is None and max_nodes == 1:
        # torchrun turns this into c10d localhost:0; elaunch's standalone is its torch-free twin.
        backend, endpoint, run_id = STANDALONE_BACKEND, STANDALONE_ENDPOINT, str(uuid.uuid4())

    if backend != "static" and not endpoint and get("master_addr") not in (None, "127.0.0.1"):
        notes.append("--master-addr is only used by the static rendezvous without --rdzv-endpoint")
    if backend != "static" and node_rank != 0:
        notes.append(f"--node-rank is only used by the static rendezvous; ignored for {backend}")

    rdzv_configs = dict(get("rdzv_conf") or {})
    out_addr: str | None = None
    out_port: int | None = None
    if backend == "static":
        if node_rank >= max_nodes:
            raise ConfigError(f"--node-rank={node_rank}: must be < the number of nodes ({max_nodes})")
        if not endpoint:
            port = DEFAULT_MASTER_PORT if master_port is None else master_port
            bare_v6 = ":" in master_addr and not master_addr.startswith("[")
            endpoint = f"[{master_addr}]:{port}" if bare_v6 else f"{master_addr}:{port}"
            _check_endpoint(backend, endpoint, "--master-addr")
        rdzv_configs["rank"] = str(node_rank)
        out_addr, out_port = _check_endpoint(backend, endpoint)
        if out_port is None:  # torch's static backend requires the port too
            raise ConfigError(f"--rdzv-endpoint={endpoint}: the static rendezvous needs host:port")

    nproc = resolve_nproc(1 if get("nproc_per_node") is None else get("nproc_per_node"))
    omp = 1 if nproc > 1 and "OMP_NUM_THREADS" not in env else None  # launch() logs the warning

    max_restarts = get("max_restarts") or 0
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts={max_restarts}: must be >= 0")
    shutdown = get("shutdown_timeout")
    shutdown = _env_shutdown_timeout(env) if shutdown is None else float(shutdown)
    if not shutdown >= 0:
        raise ConfigError(f"--shutdown-timeout={shutdown}: must be >= 0 seconds")
    hang_timeout = float(get("hang_timeout") or 0.0)
    if not 0 <= hang_timeout < float("inf"):
        raise ConfigError(f"--hang-timeout={hang_timeout}: must be >= 0 seconds (0 is off)")
    handle, forward = _signal_sets(get("signals_to_handle"), get("forward_signals"))
    monitor_interval = float(0.1 if get("monitor_interval") is None else get("monitor_interval"))
    if not monitor_interval > 0:
        raise ConfigError(f"--monitor-interval={monitor_interval}: must be > 0 seconds")
    start_method = get("start_method") or "spawn"
    if start_method not in START_METHODS:
        raise ConfigError(f"--start-method={start_method}: expected one of {', '.join(START_METHODS)}")

    cmd = build_cmd(
        script,
        tuple(get("training_script_args") or ()),
        module=bool(get("module")),
        no_python=bool(get("no_python")),
        run_path=bool(get("run_path")),
        environ=env,
    )
    no_python = bool(get("no_python")) and not get("run_path")
    warm = warm_start_modules(get("warm_start"), get("warm_start_modules"), no_python, notes)
    redirects = get("redirects")
    tee = get("tee")
    for note in notes:
        logger.warning(note)
    if standalone:
        logger.info("rendezvous: --rdzv-backend=%s --rdzv-endpoint=%s --rdzv-id=%s", backend, endpoint, run_id)
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        role=get("role") or "default",
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
        log_dir=get("log_dir") or None,
        redirects=_std_none() if redirects is None else redirects,
        tee=_std_none() if tee is None else tee,
        local_ranks_filter=get("local_ranks_filter") or None,
        node_rank=node_rank,
        master_addr=out_addr,
        master_port=out_port,
        local_addr=get("local_addr") or None,
        shutdown_timeout=shutdown,
        signals_to_handle=handle,
        forward_signals=forward,
        hang_timeout=hang_timeout,
        event_log_handler=get("event_log_handler") or "null",
        logs_specs=get("logs_specs") or None,
        virtual_local_rank=bool(get("virtual_local_rank")),
        numa_binding=get("numa_binding") or None,
        duplicate_stdout_filters=tuple(get("duplicate_stdout_filters") or ()),
        duplicate_stderr_filters=tuple(get("duplicate_stderr_filters") or ()),
        log_line_prefix_template=env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        omp_num_threads=omp,
        cmd=cmd,
        standalone=standalone,
        warm_start_modules=warm,
    )
