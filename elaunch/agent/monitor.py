"""Watching one attempt's workers until the group is no longer RUNNING.

Mirrors the monitoring half of torch's ``SimpleElasticAgent._invoke_run`` (its
``_monitor_workers`` every ``--monitor-interval``, then ``num_nodes_waiting``), and
adds what elaunch watches besides: the job's facts in the rendezvous (a failure
or verdict published by another node), and its watchdogs
(:class:`~elaunch.agent.watchdog.Watchdog`: hangs, workers stuck in the kernel,
torch's file timer).
:class:`GroupMonitor` only observes and returns a
:class:`~elaunch.agent.decide.Verdict` (with a watchdog's
:class:`~elaunch.agent.watchdog.Alarm`, after killing the workers it names); the
agent owns what follows (stopping, restarting, counting).

Between checks it sleeps on the workers' pidfds and the wake pipe (signals
included), so an idle agent costs nothing: it wakes every ``--monitor-interval``
only for what can change without a child exiting (:meth:`GroupMonitor.polls`) —
the rendezvous where other nodes may join, leave or publish the job's facts,
and the watchdogs. A standalone or static job with no watchdog that polls wakes
only when a worker exits or a signal comes.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence

from elaunch.agent.decide import Verdict, judge
from elaunch.agent.events import AgentEvents
from elaunch.agent.failures import describe_exits
from elaunch.agent.job import JobView
from elaunch.agent.watchdog import Alarm, Watchdog, Watched, send_signals
from elaunch.procs import AttemptLogs, WorkerProcesses
from elaunch.rendezvous.contract import JobState, RendezvousError, RendezvousHandler
from elaunch.spec import WorkerGroup

log = logging.getLogger("elaunch.agent")


def failed_elsewhere(job: JobState, round: int) -> bool:
    """True when another node reported a failure of ``round`` (this node's running round).

    A hung rank that only waited on a peer (``blocked``) yields to a better root
    cause: this node's own hang watch gets the time to report the rank the others
    wait behind.
    """
    f = job.failure
    return f is not None and f.round == round and f.node != job.node and not f.blocked


class GroupMonitor:
    """Watches the running attempt of one agent: child exits, the watchdogs, the job's facts, membership.

    Args:
        rdzv: the rendezvous handler (membership counts and the job's facts).
        job: the agent's view of the job's shared facts.
        events: the node's event log (watchdogs' alarms are written there).
        interval: ``--monitor-interval``, seconds between checks of the rendezvous.
        watchdogs: polled in order at each check; the first alarm ends the watch.
        keeps_peers: called when a hang alarm kills workers; True (every worker restarts in
            process: ``elaunch.inprocess``) kills only the alarm's culprit, whose peers are
            interrupted in process instead. None: every hung worker is killed, as before.

    Attributes:
        alarm: the watchdog's alarm that ended the last watch, or None.
    """

    def __init__(self, rdzv: RendezvousHandler, job: JobView, events: AgentEvents, interval: float,
                 watchdogs: Sequence[Watchdog] = (), keeps_peers: Callable[[], bool] | None = None) -> None:
        self._keeps_peers = keeps_peers
        self._rdzv = rdzv
        self._job = job
        self._events = events
        self._interval = interval
        self._watchdogs = list(watchdogs)
        self._errors_loaded = False
        self.alarm: Alarm | None = None

    def watch(self, procs: WorkerProcesses, group: WorkerGroup, logs: AttemptLogs, log_root: str | None) -> Verdict:
        """Block until the group is no longer RUNNING; return why.

        Child exits and handled signals wake this at once. When :meth:`polls`, it
        also looks every ``interval`` seconds: at the job's shared state (the same
        read as the waiting count; a job declared failed on another node ends the
        group here too), and polls the watchdogs. Otherwise it
        sleeps until a child exits (after one first ``interval``, which loads what
        a failure will need).

        Args:
            procs: the attempt's running workers.
            group: their WorkerGroup (ranks, round).
            logs: the attempt's log destinations (error files).
            log_root: the run's log directory (stack dumps go under it).

        Returns:
            SUCCEEDED, FAILED (a worker failed, or a watchdog's alarm: :attr:`alarm`),
            MEMBERSHIP_CHANGE or JOB_FAILED.

        Raises:
            SignalException: from the agent's signal handler, during the wait.
        """
        self.alarm = None
        while True:
            codes = procs.poll()
            job = self._job.read()
            watched = Watched(group, procs.pids, codes, logs.error_file, job, log_root)
            for watchdog in self._watchdogs:
                alarm = watchdog.poll(watched)
                if alarm is not None and self._raise(alarm, procs):
                    if alarm.kind == "raised" and self._scaled_up():
                        # the workers' collectives broke because another node re-formed in process for a new node
                        return Verdict.MEMBERSHIP_CHANGE
                    # HEALTHY -> FAILED: a watchdog found running workers failed
                    return Verdict.FAILED
            verdict = self._judge(codes, job, group.round)
            if verdict is not Verdict.RUNNING:
                return verdict
            timeout = self._wait_s()  # each look: a watch may start or stop polling (progress, snapshots)
            procs.wait(timeout if self._errors_loaded or timeout is not None else self._interval)
            if not self._errors_loaded:
                # needed at the next failure: load it now that the workers are up, not on the restart's clock
                importlib.import_module("elaunch.errors")
                self._errors_loaded = True

    def _judge(self, codes: dict[int, int | None], job: JobState, round: int) -> Verdict:
        """One look's verdict (``decide.judge``): the exits, then new nodes, the job's facts, membership.

        Logs why the group stops when it does (a scale-up, a round failed elsewhere,
        a membership change, the job failed elsewhere).
        """
        verdict = judge(codes, 0, job_failed=job.failed)
        if verdict is Verdict.FAILED:
            new = self._new_nodes()
            verdict = judge(codes, 0, new)
            if verdict is Verdict.MEMBERSHIP_CHANGE:
                log.warning(
                    "workers exited (%s) while %d new node(s) joined; re-forming the group"
                    " (a scale-up, not counted as a restart)", describe_exits(codes), new,
                )
        elif verdict is Verdict.RUNNING and failed_elsewhere(job, round):
            verdict = judge(codes, 0, round_failed=True)
            log.warning("round %d failed on %s (rank %d, reported through the rendezvous); stopping this "
                        "node's workers to re-form the group", job.failure.round, job.failure.host,
                        job.failure.rank)
        elif verdict is Verdict.RUNNING:
            waiting, lost = self._rdzv.num_nodes_waiting(), self._rdzv.job_channel().num_nodes_lost()
            verdict = judge(codes, waiting + lost)
            if verdict is Verdict.MEMBERSHIP_CHANGE:
                log.warning(
                    "membership changed (%d node(s) waiting to join, %d lost); re-forming the group"
                    " (not counted as a restart)", waiting, lost,
                )
        elif verdict is Verdict.JOB_FAILED and job.failure is not None:
            log.warning("the job failed on %s (rank %d); stopping this node's workers",
                        job.failure.host, job.failure.rank)
        return verdict

    def polls(self) -> bool:
        """True when something must be looked at every ``interval`` seconds, not only on a child's exit.

        That is: a rendezvous whose membership or job facts can change while the
        group runs (``can_reform``, or one that keeps job state: other nodes'
        failures and verdicts, stack-dump requests from ``elaunch status``),
        or a watchdog that polls. Standalone and static
        rendezvous have neither membership changes nor job state: torch's agent
        polls their ``num_nodes_waiting`` (always 0) every ``--monitor-interval``.
        """
        return (any(w.polls for w in self._watchdogs) or self._rdzv.can_reform
                or self._rdzv.job_channel().keeps_job_state)

    def _wait_s(self) -> float | None:
        """Seconds until the next look: ``interval``, or a watchdog's shorter one, when something :meth:`polls`;
        else the soonest ``look_within`` of a watchdog; None when nothing asks for a look."""
        if not self.polls():
            within = [w.look_within for w in self._watchdogs if getattr(w, "look_within", None) is not None]
            return min(within) if within else None
        return min([self._interval, *(w.interval for w in self._watchdogs if w.interval)])

    def _raise(self, alarm: Alarm, procs: WorkerProcesses) -> bool:
        """Act on a watchdog's alarm (the one place): send its signals, kill the workers it names, log the event.

        Returns:
            True when the alarm fails the group (:attr:`alarm` is then set).
        """
        send_signals(alarm.signals)
        if not alarm.fails:
            return False
        local_ranks = sorted(f.local_rank for f in alarm.failures.values())
        if alarm.culprit in alarm.failures and self._keeps_peers is not None and self._keeps_peers():
            local_ranks = [alarm.failures[alarm.culprit].local_rank]  # the others wait behind it: interrupted
        if alarm.kill is not None and local_ranks:
            procs.notify(alarm.kill, local_ranks)
        if alarm.failures:
            self._events.hang(alarm.failures, alarm.culprit, stuck=alarm.kind == "stuck",
                              quiet_seconds=alarm.quiet_seconds)
        self.alarm = alarm
        return True

    def _scaled_up(self) -> bool:
        """After workers reported "raised" (in-process restart): True when new nodes joined, as for an exit in
        :meth:`_judge` (another node re-formed for them, in process, and closed these workers' connections)."""
        new = self._new_nodes()
        if new > 0:
            log.warning("workers raised while %d new node(s) joined; re-forming the group"
                        " (a scale-up, not counted as a restart)", new)
        return new > 0

    def _new_nodes(self) -> int:
        """``num_nodes_new()`` of the job channel; 0 when it cannot be read (the failure then counts)."""
        try:
            return self._rdzv.job_channel().num_nodes_new()
        except RendezvousError as exc:
            log.warning("could not check for new nodes after a worker failure: %s", exc)
            return 0

