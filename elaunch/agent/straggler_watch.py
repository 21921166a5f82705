"""The straggler watch: each rank's progress stamps sampled, exchanged between the agents per window, judged.

The decision is :mod:`elaunch.agent.stragglers` (pure); this module does the sampling,
the exchange and the telling. A daemon thread of its own, so that the samples fall at
the same wall-clock instants on every node whatever the monitor is doing:

- every ``window / SAMPLES_PER_WINDOW`` seconds of wall-clock time (the same instants on
  every host), it reads the stamps its last request got
  (:meth:`~elaunch.procs.progress_files.ProgressFiles.stamps`) and asks again
  (:meth:`~elaunch.procs.progress_files.ProgressFiles.ask_stamps`): one store per rank,
  no system call;
- at each window's end it exchanges the window's samples with the round's other nodes
  (``JobChannel.exchange``, kind ``straggler``, tagged with the window's number: one
  small JSON document per node per window), so every node judges the same samples;
- it logs a straggler named (WARNING) or cleared, writes the ``straggler`` event
  (docs/events.md; ``elaunch_straggler{rank}`` on ``--metrics-port`` follows it) and
  publishes a ``straggler`` node record for ``elaunch status``;
- with ``straggler_exclude=1``, when a rank of this node is named and the other nodes
  still make ``--nnodes``' MIN, its next look by the monitor raises a ``straggler``
  alarm: the agent stops the workers and sits out as a blamed node does (the existing
  exclusion and its ``exclude_cooldown``), and the others re-form without it.

Only while a group runs and the monitor has shown it the group (its first look of an
attempt); a new attempt starts the judgement afresh (the ranks may differ). Until a rank
of the group calls ``elaunch.progress()`` the thread wakes once a window (for the
exchange, so that the nodes stay in step), not at every instant. Stdlib only.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from elaunch.agent.stragglers import (
    SAMPLES_PER_WINDOW,
    Sample,
    StragglerState,
    doc_of,
    judge,
    samples_from_doc,
    window_lateness,
)
from elaunch.agent.watchdog import Alarm, Watched
from elaunch.features.stragglers import StragglerSettings
from elaunch.supervision import OFF, THREADS, HelperThread

log = logging.getLogger("elaunch.agent")

#: The most seconds a window's exchange waits for the other nodes' documents (it waits at most twice this).
MAX_EXCHANGE_WAIT = 2.0
#: The most seconds the run's supervisor waits for the thread at its close.
CLOSE_WAIT = 0.2


class StragglerWatch:
    """The straggler watch of one agent, across its attempts: a watchdog that never raises an alarm.

    Args:
        settings: the ``--rdzv-conf`` straggler keys.
        files: returns the node's ``ProgressFiles`` (or None while there are none).
        channel: returns the rendezvous' job channel (``exchange``, ``publish_node_record``, ``node_id``).
        events: the node's event log (``emit``).
        hostname: this host's name (in the exchanged documents, for the log lines).
        supervisor: the run's ``elaunch.supervision.Supervisor``: the monitor's first look adds the thread
            to it (started there, stopped with the run's other threads; policy off: a thread that died is
            one warning and the job goes on unwatched).
        min_nodes: ``--nnodes``' MIN: a straggler's node sits out (``straggler_exclude``) only when the
            others still make it.
        clock: seconds since the epoch (injectable for tests).

    Attributes:
        polls: False (the watch has its own thread); interval: None.
        thread: the watch's thread (a ``elaunch.supervision.HelperThread``).
        state: the decision after the last window (:class:`~elaunch.agent.stragglers.StragglerState`).
    """

    polls = False
    interval = None

    def __init__(self, settings: StragglerSettings, files: Callable[[], Any], channel: Callable[[], Any], events,
                 hostname: str, supervisor, min_nodes: int = 1, clock: Callable[[], float] = time.time) -> None:
        self._settings = settings
        self._min_nodes = min_nodes
        self._leave: str | None = None  # why this node sits out, for the monitor's next look (straggler_exclude)
        self._files, self._channel, self._events, self._host, self._clock = files, channel, events, hostname, clock
        self._period = settings.window / SAMPLES_PER_WINDOW
        self._lock = threading.Lock()
        self._ranks: dict[int, int] = {}  # local rank -> global rank of the running group ({}: none shown yet)
        self._round: int | None = None
        self._samples: dict[int, list[Sample]] = {}  # global rank -> samples not yet exchanged
        self._asked: int | None = None  # the instant of the pending stamp request
        self.state = StragglerState()
        self._where: dict[int, tuple[str, str]] = {}  # global rank -> (node id, host) of the named ranks
        self._supervisor = supervisor
        # an exchange in flight (waiting for nodes that already left) ends on its own within
        # 2 * MAX_EXCHANGE_WAIT seconds, and the thread is a daemon: the agent's exit never waits for it
        self.thread = HelperThread("straggler watch", self._run, join_timeout=CLOSE_WAIT, warn_late=False,
                                   thread_name="elaunch-straggler-watch")
        self._started = False

    def env(self, local_rank: int) -> dict[str, str]:
        return {}

    def new_attempt(self, round: int) -> None:
        """A new group: forget the samples and the decision; wait for the monitor's look to learn its ranks."""
        with self._lock:
            self._ranks, self._round, self._samples, self._asked = {}, round, {}, None
            self.state = StragglerState()
            self._leave = None

    def poll(self, watched: Watched) -> Alarm | None:
        """Learn the running group's ranks (the first look of an attempt); start the thread once. Never an alarm."""
        group = watched.group
        with self._lock:
            if not self._ranks or self._round != group.round:
                self._ranks = {w.local_rank: w.global_rank for w in group.workers}
                self._round = group.round
        if not self._started:
            self._started = True
            self._supervisor.add(self.thread, THREADS, on_death=OFF, wakes=False, start=True,
                                 note="the straggler watch is off for the rest of the run")
        with self._lock:
            leave, self._leave = self._leave, None
        if leave is not None:
            # HEALTHY -> OUT: this node's rank(s) named stragglers, straggler_exclude=1 (agent: sits out)
            return Alarm("straggler", {}, restart=True, fails=True, why=leave)
        return None

    def close(self) -> None:
        """Nothing: the run's supervisor stops the thread (waiting at most :data:`CLOSE_WAIT` seconds)."""

    # -- the thread ---------------------------------------------------------------------------------------------

    def _run(self, stop: threading.Event) -> None:
        while True:
            now = self._clock()
            instant = math.floor(now / self._period) + 1
            if not self._training():  # nothing to sample: wake at the window's end only (its exchange)
                instant = -(-instant // SAMPLES_PER_WINDOW) * SAMPLES_PER_WINDOW
            if stop.wait(max(0.0, instant * self._period - now)):
                return
            try:
                self.tick(instant)
            except Exception:  # never the agent's end: the watch goes quiet for this instant
                if stop.is_set():
                    return  # closed under it (the files, the rendezvous): the run is over
                log.exception("straggler watch: instant %d failed", instant)

    def _training(self) -> bool:
        """True once the running group is known and one of its ranks called ``elaunch.progress()``."""
        with self._lock:
            if not self._ranks:
                return False
        files = self._files()
        try:
            return files is not None and bool(files.first_calls())
        except (ValueError, RuntimeError):
            return False

    def tick(self, instant: int) -> None:
        """One sample instant: take the last request's stamps, ask again; at a window's start, judge the last one."""
        with self._lock:
            ranks, group_round = dict(self._ranks), self._round
        files = self._files() if ranks else None
        if files is not None:
            try:
                stamps, asked = files.stamps(), self._asked
                files.ask_stamps()
            except (ValueError, RuntimeError):  # the files are being closed under us: the run ends
                stamps, asked = {}, None
            with self._lock:
                if self._ranks == ranks:
                    self._asked = instant
                    if asked is not None:
                        since = asked * self._period - 0.05  # a call answering this request came after it
                        for lr, (step, ns) in stamps.items():
                            if lr in ranks and ns / 1e9 >= since:
                                self._samples.setdefault(ranks[lr], []).append(Sample(asked, step, ns / 1e9))
        if instant % SAMPLES_PER_WINDOW == 0 and group_round is not None:
            self.end_window(instant // SAMPLES_PER_WINDOW - 1, group_round)

    def end_window(self, window: int, group_round: int) -> None:
        """Exchange window ``window``'s samples with the round's nodes, judge, tell what changed."""
        with self._lock:
            mine = {g: [s for s in rows if s.instant // SAMPLES_PER_WINDOW == window]
                    for g, rows in self._samples.items()}
            self._samples = {g: [s for s in rows if s.instant // SAMPLES_PER_WINDOW > window]
                             for g, rows in self._samples.items()}
        base = window * self._settings.window
        doc = {"round": group_round, "host": self._host, **doc_of({g: r for g, r in mine.items() if r}, base)}
        channel = self._channel()
        wait = min(MAX_EXCHANGE_WAIT, self._settings.window / 4)
        docs = channel.exchange("straggler", window, doc, wait)
        samples, where = {}, {}
        for node, d in docs.items():
            if isinstance(d, dict) and d.get("round") == group_round:
                for g, rows in samples_from_doc(d, base).items():
                    samples[g], where[g] = rows, (node, str(d.get("host")))
        lateness = window_lateness(samples)
        log.debug("straggler window %d (round %d): %d node(s), samples %s, %d steps compared, step time %s s, "
                  "lateness %s", window, group_round, len(docs), {g: len(r) for g, r in samples.items()},
                  lateness.steps, lateness.step_time,
                  {g: round(x, 3) for g, x in lateness.lateness.items()})
        with self._lock:
            if self._round != group_round:
                return  # a new attempt began meanwhile: this window's judgement is stale
            before = self.state
            self.state = after = judge(before, lateness, self._settings.factor, self._settings.windows)
        if after.named != before.named:
            self._tell(window, before, after, lateness, where, channel)
            if self._settings.exclude and after.named - before.named:
                self._exclude(after, where, len(docs), channel.node_id)

    def _exclude(self, after: StragglerState, where: dict, nodes: int, me: str | None) -> None:
        """``straggler_exclude=1``: have this node sit out when a rank of its own is named and MIN still holds.

        Every node judges alike; only a named rank's node acts, the others re-form without it.
        """
        named_nodes = {where[g][0] for g in after.named if g in where}
        mine = sorted(g for g in after.named if where.get(g, ("",))[0] == me)
        if not mine:
            return
        if nodes - len(named_nodes) < self._min_nodes:
            log.warning("straggler: rank(s) %s of this node stay: without the straggler node(s) %d node(s) would "
                        "be left, fewer than --nnodes' MIN %d", mine, nodes - len(named_nodes), self._min_nodes)
            return
        with self._lock:
            self._leave = (f"rank(s) {', '.join(map(str, mine))} of this node were named stragglers "
                           "(rdzv conf straggler_exclude=1)")

    def _tell(self, window: int, before: StragglerState, after: StragglerState, lateness, where, channel) -> None:
        """Log, write the ``straggler`` event and publish the ``straggler`` record: the named set changed."""
        s = self._settings
        named = sorted(after.named - before.named)
        cleared = sorted(before.named - after.named)
        rows = []
        for g in named:
            node, host = where.get(g, ("?", "?"))
            late = lateness.lateness.get(g, 0.0)
            rows.append({"rank": g, "node": node, "host": host, "lateness": round(late, 3)})
            log.warning("straggler: rank %d on %s (node %s) reports its steps %.2f of a step (%.3g s) after the "
                        "other ranks' median, in %d windows of %g s in a row (straggler_factor %g)%s", g, host, node,
                        late, late * (lateness.step_time or 0.0), after.streaks.get(g, 0), s.window, s.factor,
                        "" if not s.exclude else "; its node sits out the next round (straggler_exclude)")
        for g in cleared:
            log.info("straggler: rank %d is no longer late (window of %g s)", g, s.window)
        step_time = None if lateness.step_time is None else round(lateness.step_time, 6)
        self._events.emit("straggler", named=rows, cleared=cleared, stragglers=sorted(after.named),
                          step_time=step_time, window=s.window, windows=s.windows, factor=s.factor,
                          window_start=window * s.window)
        try:
            channel.publish_node_record("straggler", {
                "round": self._round, "at": self._clock(), "stragglers": sorted(after.named),
                "named": {str(g): {"node": where.get(g, ("?",))[0], "host": where.get(g, ("?", "?"))[1],
                                   "lateness": round(lateness.lateness.get(g, 0.0), 3)} for g in sorted(after.named)},
                "step_time": step_time})
        except Exception as exc:  # the record is for elaunch status only
            log.debug("straggler: could not publish the record: %s", exc)
