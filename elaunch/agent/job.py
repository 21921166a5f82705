"""The agent's view of the whole job through the rendezvous (job-wide supervision).

What one agent learns that ends or restarts the job goes through the rendezvous,
where every agent's monitor already looks: the job's restart count (one per failed
round, whichever node saw it), the verdict that the job failed with its root
cause, and the bad-node exclusion. :class:`JobView` applies the pure decisions of
``decide.py`` through the handler's job channel (``RendezvousHandler.job_channel()``)
and is the one owner of the restart budget (``--max-restarts`` and the job's count);
handlers without job state (static, standalone) make it count alone, as torchrun's
agent does.
"""

from __future__ import annotations

import logging
import time

from elaunch.agent.decide import Step, Verdict, next_step, sits_out
from elaunch.agent.failures import from_record, to_record
from elaunch.rendezvous.contract import (
    FailureRecord,
    JobState,
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
)
from elaunch.spec import ProcessFailure, RunResult, WorkerState

log = logging.getLogger("elaunch.agent")


class JobView:
    """Reads and writes the job's shared facts for one agent; owns the job's restart budget.

    Args:
        rdzv: the rendezvous handler (the job's facts go through its ``job_channel()``;
            leaving and rejoining through the handler).
        max_restarts: ``--max-restarts``, the job's budget of failure restarts.
        interval: ``--monitor-interval``, seconds between looks at the job while this
            node sits out.
        sleep: sleeps a number of seconds (between those looks; injectable for tests).

    Attributes:
        state: the job's facts as last read (empty until a backend with job state answers).
        max_restarts: the job's budget of failure restarts (>= 0).
        restarts: the job's failure restarts so far: the rendezvous' count where it keeps
            one (:meth:`joined`, :meth:`decide`), else this agent's own.
    """

    def __init__(self, rdzv: RendezvousHandler, max_restarts: int, interval: float = 0.1,
                 sleep=time.sleep) -> None:
        self._rdzv = rdzv
        self._channel = rdzv.job_channel()
        self.max_restarts = max_restarts
        self.restarts = 0
        self._interval = interval
        self._sleep = sleep
        self._fresh_after = 0  # the job's restarts when this node last came back from sitting out
        self.state = JobState()

    def read(self) -> JobState:
        """The job's facts from the monitor's read; the last ones known when it cannot be read."""
        try:
            job = self._channel.state()
        except RendezvousError as exc:
            log.warning("could not read the job's state: %s", exc)
            return self.state
        if job is not None:
            self.state = job
        return self.state

    def root_of(self, round: int) -> FailureRecord | None:
        """The job's root cause of ``round``'s failure from a fresh read, or None (not known, or no job state)."""
        job = self.read() if self.state.node else None
        if job is None or job.failure is None or job.failure.round != round:
            return None
        return job.failure

    @property
    def left(self) -> int:
        """Failure restarts the job has left (``max_restarts - restarts``; <= 0: none)."""
        return self.max_restarts - self.restarts

    def joined(self, restart_count: int | None) -> None:
        """A round formed: take the job's count from it (``RendezvousInfo.restart_count``; None: none kept)."""
        if restart_count is not None:
            self.restarts = restart_count

    def decide(self, verdict: Verdict, record: FailureRecord | None = None,
               fixable: bool = True) -> tuple[Step, FailureRecord | None]:
        """What follows a stopped group: :func:`~elaunch.agent.decide.next_step` on the job's budget.

        A fixable failure (``verdict`` FAILED with this node's ``record``) is counted for
        the job first (:meth:`_count`); every other stop is decided on the count as it is.

        Args:
            verdict: why the group stopped (not RUNNING).
            record: the round's root cause as this node saw it (a FAILED verdict).
            fixable: False for a failure no restart fixes.

        Returns:
            (the step; the job's root cause of a counted failure, else ``record``).

        Raises:
            RendezvousError: the rendezvous could not be written.
        """
        if verdict is not Verdict.FAILED or not fixable:
            return next_step(verdict, self.restarts, self.max_restarts, fixable), record
        return self._count(record)

    def _count(self, record: FailureRecord) -> tuple[Step, FailureRecord]:
        """Count a failed round for the job; on a spent budget declare the job failed.

        Returns:
            (RESTART, FINISH_FAILED, or REJOIN when a lost member of the round caused
            the failure (``JobState.lost``: not counted); the job's root cause).
            :attr:`restarts` is the job's count after it.
        """
        job = self._channel.record_failure(record)
        if job is None:  # no job state: this agent counts alone (static, standalone)
            used, lost = self.restarts, False
        else:
            self.state = job
            if job.failed:  # declared failed by another node meanwhile
                self._channel.acknowledge_failure()
                self.restarts = job.restarts
                return Step.FINISH_FAILED, job.failure or record
            used, lost = job.restarts - 1, bool(job.lost)  # before this round's failure
        step = next_step(Verdict.FAILED, used, self.max_restarts, lost=lost)
        if step is Step.REJOIN:  # a node loss, not a failure of the job: re-form, uncounted
            self.restarts = job.restarts
            return step, record
        if step is Step.FINISH_FAILED:
            self.restarts = used
            return step, self._channel.fail_job(record)
        self.restarts = used + 1
        return step, job.failure if job is not None and job.failure is not None else record

    def fail(self, record: FailureRecord) -> FailureRecord:
        """Declare the job failed at once (a failure no restart fixes); return the job's root cause."""
        return self._channel.fail_job(record)

    def failed_elsewhere(self, root: FailureRecord | None) -> RunResult:
        """The job failed on another node: acknowledge it and report its root cause."""
        self._channel.acknowledge_failure()
        if root is None:  # failed without a record: say so rather than invent one
            root = FailureRecord(round=-1, at=time.time(), host="<unknown>", message="the job was declared failed")
        log.info("the job failed on %s (rank %d, exitcode %d); this node's workers are stopped",
                 root.host, root.rank, root.exitcode)
        return RunResult(WorkerState.FAILED, failures={root.rank: from_record(root)}, restarts=self.restarts,
                         root_rank=root.rank)

    def succeed(self) -> None:
        """Declare the job succeeded (best effort): nodes waiting or sitting out exit 0 when they see it."""
        try:
            self._channel.succeed_job()
        except RendezvousError as exc:  # the job did succeed; only the watchers may not hear of it
            log.warning("could not publish the job's success: %s", exc)

    def sit_out_if_blamed(self) -> RunResult | None:
        """Bad-node exclusion: sit out ``exclude_cooldown`` seconds when ``decide.sits_out`` says so.

        Leaves the round (the others re-form without this node) and watches the job
        every ``interval`` seconds meanwhile, as a spare does: when the others end
        it, this node ends too, at once. A handled signal still interrupts the wait.

        Returns:
            None: this node did not sit out, or sat the cooldown out and rejoins now.
            Otherwise the job ended meanwhile: SUCCEEDED (torchrun's surplus nodes exit 0)
            or FAILED with the job's root cause (as :meth:`failed_elsewhere`).

        Raises:
            RendezvousClosedError: the rendezvous closed without a verdict meanwhile
                (another node ended the job on an error of its own).
        """
        job = self.state
        if not sits_out(job.blame, job.node, job.exclude_after, job.others, job.min_nodes,
                        job.restarts, self._fresh_after):
            return None
        log.warning(
            "this node's workers caused the last %d failures of the job; sitting out the next rounds for "
            "%g s (rdzv conf exclude_after=%d, exclude_cooldown=%g), the other %d node(s) go on",
            job.exclude_after, job.exclude_cooldown, job.exclude_after, job.exclude_cooldown, job.others,
        )
        return self._sit_out(job)

    def sit_out(self, why: str) -> RunResult | None:
        """Sit out ``exclude_cooldown`` seconds now, for ``why`` (the node check's verdict), as a blamed node does.

        Returns and raises as :meth:`sit_out_if_blamed`.
        """
        job = self.read()
        log.warning("%s; sitting out the next rounds for %g s (rdzv conf exclude_cooldown), the other node(s) go on",
                    why, job.exclude_cooldown)
        return self._sit_out(job)

    def _sit_out(self, job: JobState) -> RunResult | None:
        """Leave the round, watch the job ``job.exclude_cooldown`` s, then rejoin (see :meth:`sit_out_if_blamed`)."""
        try:
            self._channel.sit_out()
        except RendezvousError as exc:
            log.warning("could not sit out in the rendezvous (%s); leaving it for the cooldown", exc)
            self._rdzv.leave(rejoin=True)
        end = self._watch_while_out(job.exclude_cooldown)
        if end is not None:
            return self._ended_while_out(end)
        self._rdzv.leave(rejoin=True)  # no longer sitting out: rejoin
        self._fresh_after = job.restarts  # a new streak starts from here
        log.warning("exclusion over after %g s; rejoining the job", job.exclude_cooldown)
        return None

    def _watch_while_out(self, seconds: float) -> JobState | None:
        """Look at the job every ``interval`` s for ``seconds`` s; return its state once it ended, else None."""
        until = time.monotonic() + seconds
        unreadable = False
        while (left := until - time.monotonic()) > 0:
            self._sleep(min(self._interval, left))
            try:
                job = self._channel.state()
            except RendezvousError as exc:
                if not unreadable:  # once: it may stay unreachable for the whole cooldown
                    log.warning("could not read the job's state while sitting out: %s", exc)
                unreadable = True
                continue
            unreadable = False
            if job is not None:
                self.state = job
                if job.closed:
                    return job
        return None

    def _ended_while_out(self, job: JobState) -> RunResult:
        """The job ended while this node sat out: its result here (see :meth:`sit_out_if_blamed`)."""
        if job.failed:
            # OUT -> FAILED: the job failed on another node (acknowledged: that node waits for it)
            return self.failed_elsewhere(job.failure)
        self._rdzv.leave(rejoin=True)  # out of the state: the node that ended the job waits for that
        if job.succeeded:
            # OUT -> SUCCEEDED: the others finished the job
            log.warning("the job succeeded while this node sat out; nothing left to run")
            return RunResult(WorkerState.SUCCEEDED, restarts=self.restarts)
        raise RendezvousClosedError("the rendezvous was closed while this node sat out, without the job's "
                                    "success or failure (another node ended it on an error)")


def local_record(failure: ProcessFailure, round: int, hung: bool = False, blocked: bool = False,
                 stopped: bool = False) -> FailureRecord:
    """The record of this node's failure as the rendezvous carries it (text as in the summary)."""
    from elaunch.errors import failure_text, failure_time

    return to_record(failure, round, failure_text(failure), failure_time(failure), hung=hung, blocked=blocked,
                     stopped=stopped)
