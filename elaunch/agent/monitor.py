"""Watching one attempt's workers until the group is no longer RUNNING.

Mirrors the monitoring half of torch's ``SimpleElasticAgent._invoke_run`` (its
``_monitor_workers`` every ``monitor_interval``, then ``num_nodes_waiting``), and
adds what elaunch watches besides: the job's facts in the rendezvous (a failure
or verdict published by another node, stack-dump requests), hangs
(``--hang-timeout``), workers stuck in the kernel. :class:`GroupMonitor` only
observes and returns a :class:`~elaunch.agent.decide.Verdict`; the agent owns
what follows (stopping, restarting, counting).

Between checks it sleeps on the workers' pidfds and the wake pipe (signals
included), so an idle agent costs nothing: it wakes every ``--monitor-interval``
only for what can change without a child exiting (:meth:`GroupMonitor.polls`) —
the rendezvous where other nodes may join, leave or publish the job's facts,
``--hang-timeout``'s progress counters, the D-state watch. A standalone or
static job with neither watch wakes only when a worker exits or a signal comes.
"""

from __future__ import annotations

import importlib
import logging
import os

from elaunch.agent.decide import Verdict, judge
from elaunch.agent.events import AgentEvents
from elaunch.agent.failures import describe_exits
from elaunch.agent.hang_response import HangResponse
from elaunch.agent.job import JobView
from elaunch.agent.stuck import UninterruptibleWatch
from elaunch.procs import AttemptLogs, WorkerProcesses
from elaunch.rendezvous.api import JobState, RendezvousError, RendezvousHandler
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
    """Watches the running attempt of one agent: child exits, hangs, the job's facts, membership.

    Args:
        rdzv: the rendezvous handler (membership counts and the job's facts).
        job: the agent's view of the job's shared facts.
        hangs: the hang response (progress counters, stack-dump requests).
        events: the node's event log (hangs are written there).
        interval: ``--monitor-interval``, seconds between checks of the rendezvous.
        stuck_watch: the D-state watch (``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``), or None.

    Attributes:
        stuck: local rank -> seconds in D state, when the last watch ended for that ({} otherwise).
    """

    def __init__(self, rdzv: RendezvousHandler, job: JobView, hangs: HangResponse, events: AgentEvents,
                 interval: float, stuck_watch: UninterruptibleWatch | None = None) -> None:
        self._rdzv = rdzv
        self._job = job
        self._hangs = hangs
        self._events = events
        self._interval = interval
        self._stuck_watch = stuck_watch
        self._errors_loaded = False
        self.stuck: dict[int, float] = {}

    def watch(self, procs: WorkerProcesses, group: WorkerGroup, logs: AttemptLogs, log_root: str | None) -> Verdict:
        """Block until the group is no longer RUNNING; return why.

        Child exits and handled signals wake this at once. When :meth:`polls`, it
        also looks every ``interval`` seconds: at the job's shared state (the same
        read as the waiting count; a job declared failed on another node ends the
        group here too), the progress counters, the D-state watch. Otherwise it
        sleeps until a child exits (after one first ``interval``, which loads what
        a failure will need).

        Args:
            procs: the attempt's running workers.
            group: their WorkerGroup (ranks, round).
            logs: the attempt's log destinations (error files).
            log_root: the run's log directory (stack dumps go under it).

        Returns:
            SUCCEEDED, FAILED (a worker failed, hung or is stuck), MEMBERSHIP_CHANGE
            or JOB_FAILED.

        Raises:
            SignalException: from the agent's signal handler, during the wait.
        """
        self.stuck = {}
        ranks = {w.local_rank: w.global_rank for w in group.workers}
        timeout = self._interval if self.polls() else None
        while True:
            codes = procs.poll()
            if self._stuck_watch is not None and self._found_stuck(procs, group, codes):
                return Verdict.FAILED
            job = self._job.read()
            self._hangs.answer(job, procs.pids, log_root, ranks)
            hung = self._hangs.watch.hung(codes)
            if hung and _recorded_an_error(logs, hung):
                # HEALTHY -> FAILED: quiet because it is failing (it raised and is still exiting), not hung
                return Verdict.FAILED
            verdict = judge(codes, 0, job_failed=job.failed, hung=hung)
            if hung and verdict is Verdict.FAILED:
                self._hangs.on_hang(hung, group.workers, log_root, procs.notify)
                self._events.hang(self._hangs.hung, self._hangs.culprit)
                return verdict
            if verdict is Verdict.FAILED:
                new = self._new_nodes()
                verdict = judge(codes, 0, new)
                if verdict is Verdict.MEMBERSHIP_CHANGE:
                    log.warning(
                        "workers exited (%s) while %d new node(s) joined; re-forming the group"
                        " (a scale-up, not counted as a restart)", describe_exits(codes), new,
                    )
            elif verdict is Verdict.RUNNING and failed_elsewhere(job, group.round):
                verdict = judge(codes, 0, round_failed=True)
                log.warning("round %d failed on %s (rank %d, reported through the rendezvous); stopping this "
                            "node's workers to re-form the group", job.failure.round, job.failure.host,
                            job.failure.rank)
            elif verdict is Verdict.RUNNING:
                waiting, lost = self._rdzv.num_nodes_waiting(), self._rdzv.num_nodes_lost()
                verdict = judge(codes, waiting + lost)
                if verdict is Verdict.MEMBERSHIP_CHANGE:
                    log.warning(
                        "membership changed (%d node(s) waiting to join, %d lost); re-forming the group"
                        " (not counted as a restart)", waiting, lost,
                    )
            elif verdict is Verdict.JOB_FAILED and job.failure is not None:
                log.warning("the job failed on %s (rank %d); stopping this node's workers",
                            job.failure.host, job.failure.rank)
            if verdict is not Verdict.RUNNING:
                return verdict
            procs.wait(timeout if self._errors_loaded else self._interval)
            if not self._errors_loaded:
                # needed at the next failure: load it now that the workers are up, not on the restart's clock
                importlib.import_module("elaunch.errors")
                self._errors_loaded = True

    def polls(self) -> bool:
        """True when something must be looked at every ``interval`` seconds, not only on a child's exit.

        That is: a rendezvous whose membership or job facts can change while the
        group runs (``can_reform()``, or one that keeps job state: other nodes'
        failures and verdicts, stack-dump requests from ``elaunch status``),
        ``--hang-timeout`` > 0, or the D-state watch. Standalone and static
        rendezvous have neither membership changes nor job state: torch's agent
        polls their ``num_nodes_waiting`` (always 0) every ``monitor_interval``.
        """
        if self._hangs.watch.hang_timeout > 0 or self._stuck_watch is not None or self._rdzv.can_reform():
            return True
        try:
            return self._rdzv.job_state() is not None
        except RendezvousError:
            return True  # it has job state, only unreadable now

    def _found_stuck(self, procs: WorkerProcesses, group: WorkerGroup, codes: dict[int, int | None]) -> bool:
        """``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``: True (and logged) when a running worker is stuck in D state."""
        self.stuck = self._stuck_watch.stuck({lr: pid for lr, pid in procs.pids.items() if codes.get(lr) is None})
        if self.stuck:
            self._events.hang({group.workers[lr].global_rank: dwell for lr, dwell in self.stuck.items()},
                              None, stuck=True)
        for lr, dwell in sorted(self.stuck.items()):
            log.error("worker pid=%d (local rank %d) stuck in uninterruptible sleep (D state) for %.1f s (>= %g s); "
                      "the job ends without restarts", procs.pids[lr], lr, dwell, self._stuck_watch.timeout)
        return bool(self.stuck)

    def _new_nodes(self) -> int:
        """``num_nodes_new()`` of the rendezvous; 0 when it cannot be read (the failure then counts)."""
        try:
            return self._rdzv.num_nodes_new()
        except RendezvousError as exc:
            log.warning("could not check for new nodes after a worker failure: %s", exc)
            return 0


def _recorded_an_error(logs: AttemptLogs, local_ranks: list[int]) -> bool:
    """True when one of ``local_ranks`` wrote its error file (it raised: a failure on its way out)."""
    files = logs.error_file
    return any(files.get(lr) and os.path.exists(files[lr]) for lr in local_ranks)
