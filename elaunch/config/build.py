"""build_config: the LaunchOptions of one launch resolved into a LaunchConfig.

Stdlib only: torch is imported lazily, and only by ``elaunch.config.nproc`` when
``--nproc-per-node`` is ``gpu``, ``xpu`` or ``auto``. This is the one place where
the launcher reads the environment (``OMP_NUM_THREADS``, ``PYTHON_EXEC``, the option
table's torch fallbacks such as ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``,
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, ``PATH``); the mapping is passed in explicitly so tests need no monkeypatching.

Mirrors ``torch.distributed.run.config_from_args`` and ``run`` (standalone and
single-node static rewriting, static endpoint defaults, worker argv).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import fields
from typing import NamedTuple

from elaunch.config.errors import ConfigError
from elaunch.config.launch_config import STANDALONE_ENDPOINT, LaunchConfig
from elaunch.config.nproc import resolve_nproc
from elaunch.config.options import DEFAULT_MASTER_PORT, OPTIONS, LaunchOptions, replicas_for
from elaunch.config.secret import job_secret
from elaunch.config.worker_cmd import build_cmd, warm_start_modules
from elaunch.features.event_log import EVENT_LOG_HANDLERS
from elaunch.features.node_check import DEFAULT_SLOW_FACTOR, parse_slow_factor
from elaunch.features.stragglers import StragglerSettings
from elaunch.rendezvous.contract import RendezvousConfigError
from elaunch.rendezvous.registry import ENDPOINT_LIST_BACKENDS, STANDALONE_BACKEND, is_builtin

__all__ = ["build_config", "resolve"]

logger = logging.getLogger("elaunch.config")


def _check_endpoint(backend: str, endpoint: str, label: str = "--rdzv-endpoint") -> tuple[str, int | None]:
    """Check ``endpoint`` as the command line needs it (brackets around IPv6, port 1-65535).

    Returns:
        The first ``(host, port)`` (an etcd backend takes a comma-separated list).

    Raises:
        ConfigError: the endpoint, or one entry of an etcd list, is malformed.
    """
    from elaunch.rendezvous.endpoint import parse_endpoint, parse_endpoints  # not on --standalone's path

    try:
        if backend in ENDPOINT_LIST_BACKENDS:
            return parse_endpoints(endpoint, label=label)[0]
        if not endpoint.strip():
            raise ConfigError(f"{label}={endpoint}: empty endpoint in the list")
        return parse_endpoint(endpoint, label=label)
    except RendezvousConfigError as exc:
        raise ConfigError(str(exc)) from None


class _Rendezvous(NamedTuple):  # not a dataclass: half a millisecond less at every start
    """The rendezvous a launch uses, after torchrun's rewriting (LaunchConfig's ``rdzv_*`` fields)."""

    backend: str
    endpoint: str
    run_id: str
    configs: dict[str, str]


def _rendezvous(o: LaunchOptions) -> tuple[_Rendezvous, list[str]]:
    """Choose the rendezvous as torch's ``run`` does; return it and the warnings to log.

    ``--standalone``, and a single-node static job without an endpoint or a
    ``--master-port``, get elaunch's standalone rendezvous (torchrun's c10d on
    ``localhost:0``, minus torch) with a fresh uuid4 run id.

    Raises:
        ConfigError: a malformed endpoint, ``--standalone`` with MAX nodes > 1, or a
            static rendezvous that :func:`_static` rejects.
    """
    notes: list[str] = []
    backend, endpoint, run_id = o.rdzv_backend, o.rdzv_endpoint, o.rdzv_id
    min_nodes, max_nodes = o.nnodes
    if endpoint and is_builtin(backend):  # a torchrun.handlers plugin reads its endpoint itself
        _check_endpoint(backend, endpoint)
    if o.standalone:
        if max_nodes != 1:
            raise ConfigError(f"--nnodes={min_nodes}:{max_nodes}: --standalone runs a single node")
        if (backend, endpoint, run_id) != ("static", "", "none"):
            notes.append("--standalone: ignoring the given --rdzv-backend/--rdzv-endpoint/--rdzv-id")
    if o.standalone or (backend == "static" and not endpoint and o.master_port is None and max_nodes == 1):
        # torchrun turns the latter into c10d localhost:0; elaunch's standalone is its torch-free twin.
        backend, endpoint, run_id = STANDALONE_BACKEND, STANDALONE_ENDPOINT, str(uuid.uuid4())
    if backend != "static" and not endpoint and o.master_addr != "127.0.0.1":
        notes.append("--master-addr is only used by the static rendezvous without --rdzv-endpoint")
    if backend != "static" and o.node_rank != 0:
        notes.append(f"--node-rank is only used by the static rendezvous; ignored for {backend}")
    if backend == "static":
        return _static(o, endpoint, run_id), notes
    return _Rendezvous(backend, endpoint, run_id, dict(o.rdzv_conf)), notes


def _static(o: LaunchOptions, endpoint: str, run_id: str) -> _Rendezvous:
    """The static rendezvous (torch's ``static_tcp_rendezvous``): rank conf and store address.

    Without ``--rdzv-endpoint`` the endpoint is ``--master-addr:--master-port``
    (port 29500 by default; an IPv6 address gets brackets).

    Raises:
        ConfigError: ``--node-rank`` >= MAX nodes, or an endpoint without a port.
    """
    max_nodes = o.nnodes[1]
    if o.node_rank >= max_nodes:
        raise ConfigError(f"--node-rank={o.node_rank}: must be < the number of nodes ({max_nodes})")
    label = "--rdzv-endpoint"
    if not endpoint:
        port = DEFAULT_MASTER_PORT if o.master_port is None else o.master_port
        bare_v6 = ":" in o.master_addr and not o.master_addr.startswith("[")
        endpoint = f"[{o.master_addr}]:{port}" if bare_v6 else f"{o.master_addr}:{port}"
        label = "--master-addr"
    _, port = _check_endpoint("static", endpoint, label)
    if port is None:  # torch's static backend requires the port too
        raise ConfigError(f"--rdzv-endpoint={endpoint}: the static rendezvous needs host:port")
    return _Rendezvous("static", endpoint, run_id, {**o.rdzv_conf, "rank": str(o.node_rank)})


def _checkpoint_dir(path: str | None) -> str | None:
    """``--checkpoint-dir`` as an absolute path (the persister runs elsewhere), or None.

    Raises:
        ConfigError: it names something that is not a directory.
    """
    if not path:
        return None
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(full) and not os.path.isdir(full):
        raise ConfigError(f"--checkpoint-dir={path}: not a directory")
    return full


def _slow_factor(conf: Mapping[str, str]) -> float:
    """The ``--rdzv-conf`` key ``node_check_slow_factor`` (a number > 1; 2 when not given).

    Checked whether or not ``--node-check`` is on: a bad value is bad input either way.

    Raises:
        ConfigError: not a number > 1; the message names the key and value.
    """
    if conf.get("node_check_slow_factor") is None:
        return DEFAULT_SLOW_FACTOR
    try:
        return parse_slow_factor(conf["node_check_slow_factor"])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _stragglers(conf: Mapping[str, str]) -> StragglerSettings:
    """The straggler watch's ``--rdzv-conf`` keys (``StragglerSettings.from_conf``), checked whatever the backend.

    Raises:
        ConfigError: a bad value; the message names the key and value.
    """
    try:
        return StragglerSettings.from_conf(conf)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def resolve(options: LaunchOptions, environ: Mapping[str, str]) -> tuple[LaunchConfig, list[str]]:
    """Resolve ``options`` into a LaunchConfig; return it with the warnings to log.

    What :func:`build_config` does, without logging: the checks that span several
    options (the value checks ran when ``options`` was built), the rendezvous
    rewriting, the worker count and command, and the environment's part.

    Raises:
        ConfigError: no training script, a combination that is invalid, or a
            ``--logs-specs`` name no ``torchrun.logs_specs`` entry point has, or an
            ``--event-log-handler`` torch does not know; the message names it.
    """
    o = options
    if not o.training_script:
        raise ConfigError("missing the training script (elaunch [OPTIONS] SCRIPT [ARGS]...)")
    rdzv, notes = _rendezvous(o)
    if o.logs_specs is not None:  # torch's config_from_args: an unknown name is a ValueError
        from elaunch.config.logs_specs import find_logs_specs

        find_logs_specs(o.logs_specs)
    if o.event_log_handler not in EVENT_LOG_HANDLERS:  # torchrun: a KeyError at its first event
        raise ConfigError(f"--event-log-handler={o.event_log_handler}: not a torch event handler "
                          f"(one of {', '.join(EVENT_LOG_HANDLERS)})")
    nproc = resolve_nproc(o.nproc_per_node)
    cmd = build_cmd(o.training_script, o.training_script_args, module=o.module, no_python=o.no_python,
                    run_path=o.run_path, environ=environ)
    warm, warm_notes = warm_start_modules(o.warm_start, o.warm_start_modules, o.no_python and not o.run_path)
    # an option not given takes its row's torch variable, as torch's LaunchConfig ($TORCH_ELASTIC_SHUTDOWN_TIMEOUT)
    from_env = {row.dest: row.from_environ(environ) for row in OPTIONS.values()
                if row.env_fallback and getattr(o, row.dest) is None}
    resolved = dict(
        min_nodes=o.nnodes[0],
        max_nodes=o.nnodes[1],
        nproc_per_node=nproc,
        run_id=rdzv.run_id,
        rdzv_backend=rdzv.backend,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_configs=rdzv.configs,
        **from_env,
        log_line_prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        # launch() logs the warning
        omp_num_threads=1 if nproc > 1 and "OMP_NUM_THREADS" not in environ else None,
        cmd=cmd,
        warm_start_modules=warm,
        checkpoint_replicas=replicas_for(o.checkpoint_replicas, o.nnodes[1]),
        checkpoint_dir=_checkpoint_dir(o.checkpoint_dir),
        job_secret=job_secret(environ),
        node_check_slow_factor=_slow_factor(o.rdzv_conf),
        stragglers=_stragglers(o.rdzv_conf),
    )
    # every other option is a field of the same name, as it is
    same = {f.name: getattr(o, f.name) for f in fields(LaunchConfig) if f.name in OPTIONS and f.name not in resolved}
    config = LaunchConfig(**same, **resolved)
    return config, [*notes, *warm_notes]


def build_config(options: LaunchOptions, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Resolve ``options`` into a LaunchConfig (torch ``run`` + ``config_from_args``) and log its warnings.

    Args:
        options: the launch's typed options (``elaunch.cli`` and ``elaunch.run`` build them).
        environ: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: no training script, or an invalid combination; the message names it.
            The warnings are logged only once everything is valid.
    """
    config, warnings = resolve(options, os.environ if environ is None else environ)
    for warning in warnings:
        logger.warning(warning)
    if options.standalone:
        logger.info("rendezvous: --rdzv-backend=%s --rdzv-endpoint=%s --rdzv-id=%s",
                    config.rdzv_backend, config.rdzv_endpoint, config.run_id)
    return config
