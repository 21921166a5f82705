"""Starting ``--metrics-port``'s server for a launch: bound before anything else starts, its URL logged.

The metrics themselves (what is served) are :mod:`elaunch.agent.metrics`.
"""

from __future__ import annotations

import logging
import socket

from elaunch.agent.metrics import ALL_INTERFACES, AgentMetrics

log = logging.getLogger("elaunch.agent")

__all__ = ["MetricsPortError", "serve_metrics", "start_metrics"]


class MetricsPortError(ValueError):
    """``--metrics-port``'s port cannot be bound: bad input (``elaunch.launch`` reports it as a ``ConfigError``)."""


def start_metrics(config) -> AgentMetrics | None:
    """The metrics of a launch (``LaunchConfig``: ``metrics_port``, ``local_addr``, ``run_id``, ``role``), serving.

    Called before the rendezvous handler, the log directory or any helper exists: a port that
    cannot be bound is bad input, and nothing has to be undone. The URL is logged at WARNING
    (shown by default), with the port actually bound (``--metrics-port=0``).

    Returns:
        The serving :class:`AgentMetrics` (the agent calls :meth:`AgentMetrics.watch`; the caller
        :meth:`AgentMetrics.close`), or None without ``--metrics-port``.

    Raises:
        MetricsPortError: the port cannot be bound (taken, or ``--local-addr`` is not this host's).
    """
    if config.metrics_port is None:
        return None
    metrics = AgentMetrics(config.run_id, None, config.role)
    serve_metrics(metrics, config.metrics_port, config.local_addr)
    return metrics


def serve_metrics(metrics: AgentMetrics, port: int, addr: str | None) -> None:
    """Start ``metrics``' server for ``--metrics-port`` and log its URL (WARNING: shown by default).

    Raises:
        MetricsPortError: the port cannot be bound (taken, or ``--local-addr`` is not this host's): bad input.
    """
    try:
        host, bound = metrics.serve(port, addr)
    except OSError as exc:
        where = f"{addr or ALL_INTERFACES}:{port}"
        raise MetricsPortError(f"--metrics-port={port}: cannot listen on {where}: {exc.strerror or exc}") from None
    shown = socket.gethostname() if host == ALL_INTERFACES else (f"[{host}]" if ":" in host else host)
    log.warning("metrics on http://%s:%d/metrics%s", shown, bound, " (every interface)" if host == ALL_INTERFACES else "")
