"""``--metrics-port``: the agent's Prometheus metrics, served at ``/metrics`` through ``prometheus_client``.

A launch starts the server (:func:`start_metrics`) before the rendezvous handler, the
log directory or any helper exists, and logs its URL: a port that cannot be bound
raises :class:`MetricsPortError`, bad input (``elaunch.launch`` reports it as a
``ConfigError``) with nothing to undo. The agent then hands its event log and the
scrape-time sources to :meth:`AgentMetrics.watch`.

What follows from events (restarts, rounds, membership, hangs, the goodput
ledger) is folded from the agent's event log as it is written: :class:`AgentMetrics`
is an observer of :class:`~elaunch.agent.events.EventLog` (``add_observer``) and
gets the very dicts written to ``events.jsonl``, so the metrics and the file
cannot disagree. What is state rather than an event (each local rank's progress,
the workers' states between the agent's looks, the newest snapshot) is read when
Prometheus scrapes, by a custom collector, from callables the agent hands in;
none of them touches the network or the rendezvous' store, so a scrape costs
well under the 10 ms budget. The names, types, labels and units are listed in
docs/metrics.md ("Metrics").

Every metric has the labels ``run_id``, ``node`` (the rendezvous' node id, as in
the event log) and ``role``; per-rank gauges add ``local_rank``. The metrics live
in their own ``CollectorRegistry`` (never the process-wide default one: under
``elaunch.run`` the agent runs inside a user's program, which may have its own).
torchrun has nothing of the kind (only torch's in-process ``metrics`` API with a
console handler).

Every family is built at scrape time by one collector from figures this module
keeps (prometheus_client's metric families, registry, text format and server do
the rest), rather than through ``Counter``/``Histogram`` objects: those add a
``<name>_created`` gauge family per metric (six names outside the contract; turning
them off is a process-wide setting, the user's program's too under ``elaunch.run``),
write to files under ``$PROMETHEUS_MULTIPROC_DIR`` when a user's job sets it, and
each takes a lock of its own.

Threads: :meth:`AgentMetrics.observe` runs in the thread that emits (the agent's
main thread; the straggler watch's thread for ``straggler``); a scrape runs in the
HTTP server's thread. One lock guards the
figures between them. No signal handler emits (the agent's loop writes a
``notice``), so the lock is never taken from a handler; ``notice`` events are not
looked at (no metric counts them).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from elaunch.agent.ledger import CATEGORIES, Ledger
from elaunch.agent.progress_sampler import ProgressSampler
from elaunch.supervision import OFF, THREADS, HelperDied

if TYPE_CHECKING:
    from elaunch.checkpoint.keeper import NodeSnapshot

log = logging.getLogger("elaunch.agent")

__all__ = ["ALL_INTERFACES", "BUCKETS", "CAUSES", "LABELS", "WORKER_STATES", "AgentMetrics", "MetricsPortError",
           "serve_metrics", "start_metrics"]

#: The labels of every metric (per-rank gauges add ``local_rank``).
LABELS = ("run_id", "node", "role")
#: ``elaunch_restarts_total``'s ``cause`` values, each exported from the start (0 until it happens).
CAUSES = ("failure", "membership", "node_lost")
#: ``elaunch_workers``'s ``state`` values.
WORKER_STATES = ("running", "succeeded", "failed", "stopped")
#: ``elaunch_rendezvous_duration_seconds`` bucket bounds, seconds: a standalone round takes
#: milliseconds, a c10d or etcd round a second or more, one waiting for nodes minutes.
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, float("inf"))
#: The event-fed counters besides restarts: (key, name without ``_total``, help).
_COUNTERS = (
    ("rounds", "elaunch_rendezvous_rounds", "Rendezvous rounds this node completed"),
    ("changes", "elaunch_membership_changes", "Rounds whose member nodes differ from this node's previous round's"),
    ("losses", "elaunch_node_losses", "Nodes of this node's previous round missing from its next one (killed, cut "
     "off, stopped by a signal, sitting out)"),
    ("hangs", "elaunch_hang_verdicts", "Hang verdicts on this node (--hang-timeout, or workers stuck in "
     "uninterruptible sleep)"),
    ("inprocess", "elaunch_inprocess_restarts", "Restarts in which this node's surviving workers kept their "
     "processes (elaunch.restartable)"),
)
#: Where the server listens without ``--local-addr``: every IPv4 interface.
ALL_INTERFACES = "0.0.0.0"


def _nothing() -> dict:
    return {}


class AgentMetrics:
    """One agent run's metrics: counters fed by events, gauges read at scrape time.

    Args:
        run_id, node, role: the values of the labels every metric has; ``node`` None until
            :meth:`watch` names it (a scrape before then answers no metric).
        progress: returns local rank -> ``(seconds since its last elaunch.progress() or None
            before any call, last reported step or None)`` for the running group; no I/O.
        exit_codes: returns local rank -> exit code (None: running) of the running group as the
            agent last saw them, without reaping; no I/O.
        snapshot: returns this node's :class:`~elaunch.checkpoint.keeper.NodeSnapshot`, or None (in-memory
            checkpoints off);
            it may read ``/dev/shm`` but nothing over the network.
        clock: seconds since the epoch (the ledger's ``now``; injectable for tests).

    Attributes:
        registry: the ``CollectorRegistry`` holding every metric (give it to ``generate_latest``).
        address: ``(host, port)`` the server listens on, once :meth:`serve` started it.
    """

    def __init__(self, run_id: str, node: str | None, role: str, *,
                 progress: Callable[[], Mapping[int, tuple[float | None, int | None]]] = _nothing,
                 exit_codes: Callable[[], Mapping[int, int | None]] = _nothing,
                 snapshot: Callable[[], NodeSnapshot | None] = lambda: None,
                 clock: Callable[[], float] = time.time) -> None:
        self._const = {"run_id": run_id, "node": node, "role": role}
        self._progress, self._exit_codes, self._snapshot, self._clock = progress, exit_codes, snapshot, clock
        self._lock = threading.Lock()
        self._ledger = Ledger()
        self._group: dict[int, str] = {}  # local rank -> state, from the events of this node's last group
        self._ledger_shown = dict.fromkeys(CATEGORIES, 0.0)  # what the counters said last: they never go down
        self._server = self._thread = None
        self._told = False  # check() reported the server's thread gone
        self.address: tuple[str, int] | None = None
        # the event-fed counters, exported by the collector (_event_families)
        self._restarts = dict.fromkeys(CAUSES, 0)
        self._counts = {"rounds": 0, "changes": 0, "losses": 0, "hangs": 0, "inprocess": 0}
        self._round_buckets = [0] * len(BUCKETS)  # rounds that took at most BUCKETS[i] seconds
        self._round_seconds = 0.0
        self._stragglers: dict[int, int] = {}  # global rank -> 1 named, 0 cleared, this node's last group
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_ScrapeTime(self))

    def watch(self, events, node: str, supervisor, *, progress_files: Callable[[], Any] | None = None,
              exit_codes: Callable[[], Mapping[int, int | None]] | None = None,
              snapshot: Callable[[], NodeSnapshot | None] | None = None) -> None:
        """Observe ``events`` (an ``EventLog``) from now on, as node ``node``; set the scrape-time sources given.

        The agent calls this once its run's event log is open (the server started before,
        so that a taken port is bad input before anything else starts).

        Args:
            supervisor: the run's ``elaunch.supervision.Supervisor``: it starts the sampler's thread and
                stops it with the run's other threads (policy off: a sampler that died is one warning,
                and each scrape still reads the counters once).
            progress_files: returns the node's ``ProgressFiles`` (or None): a
                :class:`ProgressSampler` reads them for the progress gauges.
            exit_codes, snapshot: as the constructor's.
        """
        if progress_files is not None:
            sampler = ProgressSampler(progress_files)
            supervisor.add(sampler.thread, THREADS, on_death=OFF, wakes=False, start=True,
                           note="the progress gauges' ages are dated at each scrape only")
            self._progress = sampler.table
        self._exit_codes = exit_codes or self._exit_codes
        self._snapshot = snapshot or self._snapshot
        self._const = {**self._const, "node": node}
        events.add_observer(self.observe)

    # -- events ------------------------------------------------------------------------------------------------

    def observe(self, event: Mapping[str, Any]) -> None:
        """Fold one event dict of ``events.jsonl`` (an ``EventLog`` observer); unknown kinds change nothing.

        The mapping (docs/metrics.md): ``restart`` -> ``elaunch_restarts_total{cause}``;
        ``rendezvous_complete`` -> ``elaunch_rendezvous_rounds_total`` and its ``seconds`` into
        ``elaunch_rendezvous_duration_seconds``; ``membership_change`` ->
        ``elaunch_membership_changes_total``, and its ``left`` nodes into
        ``elaunch_node_losses_total``; ``hang`` -> ``elaunch_hang_verdicts_total``;
        ``inprocess_restart`` -> ``elaunch_inprocess_restarts_total``;
        ``workers_started`` / ``worker_exited`` -> the group's states (``elaunch_workers``);
        ``straggler`` -> ``elaunch_straggler{rank}`` (1 named, 0 cleared; a new group starts empty);
        every event but ``notice`` -> the ledger.
        """
        kind = event.get("kind")
        if kind == "notice":  # no metric counts it
            return
        with self._lock:
            if kind == "restart":
                cause = str(event.get("cause"))
                self._restarts[cause] = self._restarts.get(cause, 0) + 1
            elif kind == "rendezvous_complete":
                self._counts["rounds"] += 1
                seconds = event.get("seconds")
                if isinstance(seconds, (int, float)):
                    self._round_seconds += seconds
                    for i, bound in enumerate(BUCKETS):
                        self._round_buckets[i] += seconds <= bound
            elif kind == "membership_change":
                self._counts["changes"] += 1
                self._counts["losses"] += len(event.get("left") or ())
            elif kind == "hang":
                self._counts["hangs"] += 1
            elif kind == "inprocess_restart":
                self._counts["inprocess"] += 1
            elif kind == "workers_started":
                self._group = dict.fromkeys(event.get("local_ranks") or (), "running")
                self._stragglers = {}
            elif kind == "straggler":
                self._stragglers.update(dict.fromkeys(event.get("cleared") or (), 0))
                self._stragglers.update(dict.fromkeys(event.get("stragglers") or (), 1))
            elif kind == "worker_exited" and event.get("local_rank") in self._group:
                self._group[event["local_rank"]] = _exit_state(event.get("exitcode"), bool(event.get("stopped")))
            self._ledger.observe(dict(event))

    def _event_families(self, keys: list[str], values: list[str]) -> list:
        """The event-fed counters and histogram (copied under the lock)."""
        with self._lock:
            restarts, counts = dict(self._restarts), dict(self._counts)
            buckets, total = list(self._round_buckets), self._round_seconds
            stragglers = dict(self._stragglers)
        fam = CounterMetricFamily("elaunch_restarts", "Worker-group restarts on this node, by the restart event's "
                                  "cause (failure: counted against --max-restarts; membership, node_lost: not)",
                                  labels=[*keys, "cause"])
        for cause, n in restarts.items():
            fam.add_metric([*values, cause], n)
        out = [fam]
        for key, name, text in _COUNTERS:
            out.append(CounterMetricFamily(name, text, labels=keys))
            out[-1].add_metric(values, counts[key])
        hist = HistogramMetricFamily("elaunch_rendezvous_duration_seconds", "Seconds from joining a rendezvous "
                                     "round to its completion, on this node", labels=keys)
        hist.add_metric(values, [(_le(b), n) for b, n in zip(BUCKETS, buckets)], total)
        out.append(hist)
        if stragglers:  # once the straggler watch named a rank of this node's group
            fam = GaugeMetricFamily("elaunch_straggler", "1 while the straggler watch names the global rank a "
                                    "straggler (it reports its steps late), 0 once cleared", labels=[*keys, "rank"])
            for rank, named in sorted(stragglers.items()):
                fam.add_metric([*values, str(rank)], named)
            out.append(fam)
        return out

    # -- scrape time -------------------------------------------------------------------------------------------

    def worker_states(self) -> dict[str, int]:
        """``state -> workers`` of this node's last group (every state present; all 0 before a group).

        A rank still running by the events is looked up in ``exit_codes``: a worker that exited
        is counted succeeded (0) or failed before the agent stops the group and logs it.
        """
        with self._lock:
            group = dict(self._group)
        codes = self._exit_codes() if "running" in group.values() else {}
        out = dict.fromkeys(WORKER_STATES, 0)
        for lr, state in group.items():
            if state == "running" and codes.get(lr) is not None:
                state = _exit_state(codes[lr], stopped=False)
            out[state] += 1
        return out

    def ledger_seconds(self, now: float) -> tuple[dict[str, float], float | None]:
        """``(seconds per category as the counters show them, goodput)`` until ``now`` (seconds since the epoch).

        A hang verdict moves its quiet seconds from productive (or restoring) to hung in the
        ledger; a counter never goes down, so each category shows the most it ever reached:
        ``productive`` then stays flat until the ledger's own figure passes it again. The
        goodput is the ledger's, exact.
        """
        with self._lock:
            seconds = self._ledger.seconds(now)
            goodput = self._ledger.goodput(now)
            for cat, value in seconds.items():
                self._ledger_shown[cat] = max(self._ledger_shown[cat], value)
            return dict(self._ledger_shown), goodput

    def collect_now(self) -> list:
        """The metric families read at scrape time (:class:`_ScrapeTime`'s ``collect``); none before the node is known."""
        c, now = self._const, self._clock()
        if c["node"] is None:
            return []
        keys, values = list(LABELS), [c[k] for k in LABELS]
        workers = GaugeMetricFamily("elaunch_workers", "Workers of this node's last group by state",
                                    labels=[*keys, "state"])
        for state, n in self.worker_states().items():
            workers.add_metric([*values, state], n)
        age = GaugeMetricFamily("elaunch_progress_age_seconds", "Seconds since the local rank's worker last "
                                "called elaunch.progress() (absent before its first call)", labels=[*keys, "local_rank"])
        step = GaugeMetricFamily("elaunch_progress_step", "The last step the local rank's worker gave "
                                 "elaunch.progress(step=)", labels=[*keys, "local_rank"])
        for lr, (seconds, last_step) in sorted(self._progress().items()):
            if seconds is not None:
                age.add_metric([*values, str(lr)], max(seconds, 0.0))
            if last_step is not None:
                step.add_metric([*values, str(lr)], last_step)
        out = [*self._event_families(keys, values), workers, age, step, *self._snapshot_families(keys, values, now)]
        seconds, goodput = self.ledger_seconds(now)
        ledger = CounterMetricFamily("elaunch_ledger_seconds", "Seconds of this node's part of the job by goodput "
                                     "ledger category (docs/metrics.md)", labels=[*keys, "category"])
        for cat in CATEGORIES:
            ledger.add_metric([*values, cat], seconds[cat])
        out.append(ledger)
        if goodput is not None:
            out.append(GaugeMetricFamily("elaunch_goodput_ratio", "Productive seconds over all seconds of this "
                                         "node's part of the job (0-1)", labels=keys))
            out[-1].add_metric(values, goodput)
        return out

    def _snapshot_families(self, keys: list[str], values: list[str], now: float) -> list:
        snap = self._snapshot()
        if snap is None or snap.step is None:
            return []
        fams = [GaugeMetricFamily("elaunch_snapshot_step", "The newest step committed to this node's in-memory "
                                  "checkpoint slots", labels=keys),
                GaugeMetricFamily("elaunch_snapshot_age_seconds", "Seconds since the newest in-memory checkpoint "
                                  "of this node was committed", labels=keys)]
        fams[0].add_metric(values, snap.step)
        fams[1].add_metric(values, max(now - snap.time, 0.0))
        if snap.persisted_time is not None:
            fams.append(GaugeMetricFamily("elaunch_snapshot_persist_lag_seconds", "Seconds between the commits of "
                                          "the newest in-memory checkpoint and of the newest one persisted to "
                                          "--checkpoint-dir", labels=keys))
            fams[-1].add_metric(values, max(snap.time - snap.persisted_time, 0.0))
        return fams

    # -- the server --------------------------------------------------------------------------------------------

    def serve(self, port: int, addr: str | None = None) -> tuple[str, int]:
        """Serve ``/metrics`` on ``addr:port`` (``prometheus_client.start_http_server``, a daemon thread).

        Args:
            port: the TCP port; 0 picks a free one.
            addr: the address to bind (``--local-addr``), None for every IPv4 interface.

        Returns:
            ``(host, port)`` it listens on (the port actually bound).

        Raises:
            OSError: the address cannot be bound (the port is taken, the address is not this host's).
        """
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr or ALL_INTERFACES, registry=self.registry)
        self.address = (addr or ALL_INTERFACES, self._server.server_port)
        return self.address

    # -- as the launch's supervisor's helper (elaunch.supervision.Helper: tier METRICS, policy off) --------

    name = "metrics server"

    def check(self) -> bool:
        """Raise ``HelperDied`` once if the server's thread ended while it should serve; never restarts it.

        Raises:
            HelperDied: ``/metrics`` is no longer served (reported once).
        """
        if self._server is not None and not self._told and self._thread is not None and not self._thread.is_alive():
            self._told = True
            raise HelperDied(f"{self.name} thread died: nothing answers on port {self.address[1]}")
        return False

    def private_fds(self) -> tuple[int, ...]:
        """The listening socket: a worker forked from the agent does not keep the port."""
        return (self._server.fileno(),) if self._server is not None else ()

    def close(self) -> None:
        """Stop the server and close its socket (the port is free once this returns). Idempotent.

        The launch's supervisor calls it last (tier ``METRICS``), after the rendezvous was left;
        the sampler's thread is a run's helper: it stopped at the agent run's end."""
        server, self._server = self._server, None
        if server is not None:
            _shutdown(server)
            server.server_close()
            self._thread.join(timeout=5.0)


def _shutdown(server, timeout: float = 5.0) -> None:
    """End ``server``'s ``serve_forever`` loop now, not at its next look.

    ``socketserver``'s ``shutdown()`` only sets a flag that the loop reads when its
    ``select`` returns, after ``poll_interval`` (0.5 s in ``start_http_server``) of
    quiet: a job with ``--metrics-port`` ended up to 0.5 s late (400 ms measured).
    Here ``shutdown()`` runs in a thread while this one connects to the port until it
    returns: each connection wakes the ``select``, and the first look after the flag is
    set ends the loop (the connection is handled as an empty request and closed).

    Args:
        server: the serving ``WSGIServer``.
        timeout: seconds to wait for the loop to end.
    """
    host, port = server.server_address[:2]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    stopper = threading.Thread(target=server.shutdown, name="elaunch-metrics-stop", daemon=True)
    stopper.start()
    deadline = time.monotonic() + timeout
    while stopper.is_alive() and time.monotonic() < deadline:
        stopper.join(0.005)  # shutdown() sets the flag first, then waits for the loop
        if stopper.is_alive():
            try:
                socket.create_connection((host, port), timeout=0.1).close()
            except OSError:  # nothing listens any more, or refused: the loop's own look will do
                stopper.join(0.05)


class MetricsPortError(ValueError):
    """``--metrics-port``'s port cannot be bound: bad input (``elaunch.launch`` reports it as a ``ConfigError``)."""


def start_metrics(config) -> AgentMetrics | None:
    """The metrics of a launch (``LaunchConfig``: ``metrics_port``, ``local_addr``, ``run_id``, ``role``), serving.

    Called before the rendezvous handler, the log directory or any helper exists: a port that
    cannot be bound is bad input, and nothing has to be undone. The URL is logged at WARNING
    (shown by default), with the port actually bound (``--metrics-port=0``).

    Returns:
        The serving :class:`AgentMetrics` (the agent calls :meth:`AgentMetrics.watch`; the caller
        adds it to the launch's supervisor, which closes it last), or None without ``--metrics-port``.

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


class _ScrapeTime:
    """The custom collector: the gauges (and the ledger's counters) read when Prometheus scrapes."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def collect(self):
        return self._metrics.collect_now()

    def describe(self):
        return []  # names known only once collected; registering checks no clash with the event-fed ones


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _exit_state(code: int | None, stopped: bool) -> str:
    """A worker's state from its exit: ``stopped`` when the agent stopped it, else succeeded or failed."""
    if stopped:
        return "stopped"
    if code is None:
        return "running"
    return "succeeded" if code == 0 else "failed"
