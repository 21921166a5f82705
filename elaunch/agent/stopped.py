"""What the agent observed when its group stopped running, and the step decided for it.

The agent's loop (``agent.py``) watches one attempt, fills in a :class:`Stopped`
(the monitor's verdict; on a failure, the failed workers and this node's root
cause), has the job's restart budget decide the step (``JobView.decide``, through
``decide.next_step``) and hands it to the action for that step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

from elaunch.agent.decide import Step, Verdict
from elaunch.agent.failures import collect_failures
from elaunch.agent.job import local_record
from elaunch.agent.watchdog import Alarm
from elaunch.procs import AttemptLogs
from elaunch.rendezvous.contract import FailureRecord, RendezvousInfo
from elaunch.spec import ProcessFailure, WorkerGroup


@dataclasses.dataclass
class Stopped:
    """One stop of the agent's group: what was observed, and what follows.

    Attributes:
        verdict: why the group stopped (the monitor's verdict).
        info: the round the group ran in.
        group: the stopped group (None when the workers could not be started).
        failures: a failure's workers by global rank (empty otherwise).
        record: this node's root cause of a fixable failure, as the rendezvous carries it.
        codes: local rank -> exit code when the failure was seen.
        fixable: False for a failure no restart fixes.
        step: what follows (``decide.next_step`` on the job's budget).
        root: the job's root cause of a counted failure, or of a job failed elsewhere.
        sits_out: why this node leaves the job for the exclusion's cooldown (its ranks were named
            stragglers with ``straggler_exclude=1``), or None.
    """

    verdict: Verdict
    info: RendezvousInfo
    group: WorkerGroup | None
    failures: dict[int, ProcessFailure] = dataclasses.field(default_factory=dict)
    record: FailureRecord | None = None
    codes: Mapping[int, int | None] = dataclasses.field(default_factory=dict)
    fixable: bool = True
    step: Step | None = None
    root: FailureRecord | None = None
    sits_out: str | None = None

    def observe_failure(self, alarm: Alarm | None, codes: Mapping[int, int | None], times: Mapping[int, float],
                        final: Mapping[int, int | None], logs: AttemptLogs, hostname: str) -> None:
        """Fill in a failed group's failures and root cause.

        Args:
            alarm: the watchdog's alarm that failed the group, or None (a worker failed):
                it says whether a restart fixes it, the ranks it failed and its culprit.
            codes: local rank -> exit code when the failure was seen.
            times: local rank -> when each exited (seconds since the epoch).
            final: local rank -> exit code after the rest were stopped.
            logs: the attempt's log destinations (error files, stderr tails).
            hostname: this node's name for the failures.
        """
        alarm = alarm or Alarm("", {})
        if not alarm.restart:  # e.g. a worker stuck in the kernel; a restart beside it would fight it
            self.failures, self.fixable = alarm.reported(final), False
            return
        self.failures = {**collect_failures(self.group.workers, codes, times, final, logs, hostname),
                         **alarm.reported(final)}
        from elaunch.errors import root_cause

        first = self.failures.get(alarm.culprit) or root_cause(self.failures)
        self.record = local_record(first, self.info.round, hung=first.global_rank in alarm.failures,
                                   blocked=first.global_rank == alarm.culprit and alarm.blocked,
                                   stopped=first.global_rank == alarm.culprit and alarm.stopped)
        self.codes = codes


def unstartable(info: RendezvousInfo, exc: OSError, local_world_size: int, hostname: str) -> Stopped:
    """The workers could not be started (e.g. no such program): a failure no restart fixes (its node's rank 0)."""
    failure = ProcessFailure(local_rank=0, global_rank=info.rank * local_world_size, pid=-1, exitcode=1,
                             timestamp=time.time(), hostname=hostname, detail=f"could not start the workers: {exc}")
    return Stopped(Verdict.FAILED, info, None, {failure.global_rank: failure}, fixable=False)
