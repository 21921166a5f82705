"""The ``--hang-timeout`` watchdog: answer stack-dump requests (other nodes', ``elaunch status``'s), find hangs.

:class:`HangResponse` is a :class:`~elaunch.agent.watchdog.Watchdog`: each poll
answers the job's stack-dump requests, then judges the progress counters; a hang
comes back as an :class:`~elaunch.agent.watchdog.Alarm` (the hung workers as
failures, the culprit first, SIGKILL for them). The evidence comes from
:class:`~elaunch.agent.hangs.HangWatch` and the decisions from ``decide.order_hung``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping

from elaunch.agent.decide import exit_grace, order_hung
from elaunch.agent.hangs import DUMP_TIMEOUT, HangWatch, waits_on_peer
from elaunch.agent.published import publish, stacks_record
from elaunch.agent.watchdog import Alarm, Watched
from elaunch.rendezvous.api import FailureRecord, JobState, RendezvousError, RendezvousHandler
from elaunch.spec import ProcessFailure

log = logging.getLogger("elaunch.agent")


class HangResponse:
    """One agent's response to hangs, attempt after attempt.

    Args:
        watch: the progress counters and stack dumps of this node's workers.
        rdzv: the rendezvous handler (its job channel carries stack-dump requests and their answers).
        hostname: this node's name, for failures.

    Attributes:
        polls: True when ``--hang-timeout`` is on (stack-dump requests come with the rendezvous' polling).
        dumps_seen: the job's stack-dump requests answered (None: not read yet this attempt).
        answered: this round's stacks taken for another node's request, or None.
        round: the rendezvous round of the attempt.
    """

    def __init__(self, watch: HangWatch, rdzv: RendezvousHandler, hostname: str) -> None:
        self.watch = watch
        self._channel = rdzv.job_channel()
        self._hostname = hostname
        self.polls = watch.hang_timeout > 0
        self.interval = None
        self.dumps_seen: int | None = None
        self.answered: tuple[dict, str | None] | None = None
        self.round = -1

    def new_attempt(self, round: int) -> None:
        """Forget the last attempt's hang facts; zero the progress counters."""
        self.watch.new_attempt()
        self.dumps_seen, self.answered, self.round = None, None, round

    def env(self, local_rank: int) -> dict[str, str]:
        """Variables for ``local_rank``'s worker (``ELAUNCH_PROGRESS_FILE``...); {} when off."""
        return self.watch.env(local_rank)

    def close(self) -> None:
        """Remove the progress files. Idempotent."""
        self.watch.close()

    def poll(self, watched: Watched) -> Alarm | None:
        """Answer the job's stack-dump requests, then return the alarm of a hang (None: none).

        A quiet rank that wrote its error file is failing (it raised and is still
        exiting): an alarm without failures, the exit codes tell. A hang while the job
        failed elsewhere is no alarm: that failure decides.
        """
        ranks = {w.local_rank: w.global_rank for w in watched.group.workers}
        self.answer(watched.job, watched.pids, watched.log_root, ranks)
        hung = self.watch.hung(watched.codes)
        if not hung:
            return None
        if any(watched.error_files.get(lr) and os.path.exists(watched.error_files[lr]) for lr in hung):
            # HEALTHY -> FAILED: quiet because it is failing (it raised and is still exiting), not hung
            return Alarm("hang", {})
        if watched.job.failed:
            return None
        return self.on_hang(hung, watched.group.workers, watched.log_root)

    def answer(self, job: JobState, pids: Mapping[int, int], log_root: str | None,
               ranks: Mapping[int, int] | None = None) -> None:
        """Dump this node's worker stacks when another agent (or ``elaunch status``) asked since the last look.

        A request without ``dump_by`` comes from ``elaunch status --stacks``: no
        hang. The stacks are published through the rendezvous for it (``ranks``:
        local rank -> global rank) and nothing else changes: no worker is stopped,
        no hang fact is kept for this attempt.
        """
        if self.dumps_seen is None:
            self.dumps_seen = job.dump_id  # requests from before this attempt are not ours to answer
            return
        if job.dump_id <= self.dumps_seen:
            return
        self.dumps_seen = job.dump_id
        by = job.dump_by
        if by is None:
            why = "stacks requested by 'elaunch status --stacks' (no hang)"
            dumps, path = self.watch.dump(pids, log_root, f"round{self.round}_status", why)
            log.info("%s; this node's worker stacks are in %s", why, path or "(no log directory)")
            publish(self._channel, "stacks", stacks_record(job.dump_id, self.round, self._hostname, dumps, pids,
                                                        ranks or {}, path))
            self._channel.acknowledge_dump(job.dump_id)
            return
        why = f"stacks requested through the rendezvous: rank {by.rank} on {by.host} hangs"
        dumps, path = self.watch.dump(pids, log_root, f"round{self.round}_requested", why)
        log.warning("%s; this node's worker stacks are in %s", why, path or "(no log directory)")
        self._channel.acknowledge_dump(job.dump_id)
        if by is not None and by.round == self.round:
            self.answered = (dumps, path)  # this round's stacks, should our own ranks be found hung too

    def on_hang(self, hung: list[int], workers: list, log_root: str | None) -> Alarm:
        """Hung workers: ask every node for stacks, dump ours; the alarm kills the hung ones (a failure of theirs).

        The root cause is the rank the others are blocked behind (``decide.order_hung``):
        a peer stuck in the same collective goes quiet at the same moment.
        """
        from elaunch.procs.stacks import process_state

        now = time.time()
        by_lr = {w.local_rank: w for w in workers}
        pids = {lr: w.pid or -1 for lr, w in by_lr.items()}
        quiet = {lr: self.watch.quiet_for(lr) for lr in hung}
        counters = {lr: self.watch.counter(lr) for lr in by_lr}
        stopped = {lr: process_state(by_lr[lr].pid or -1) in ("T", "t") for lr in hung}
        likely = order_hung(hung, counters, quiet, {}, stopped)[0]  # before the stacks tell more
        first = by_lr[likely]
        asked = FailureRecord(round=self.round, at=now, host=self._hostname, rank=first.global_rank,
                              local_rank=likely, pid=first.pid or -1, exitcode=-signal.SIGKILL,
                              message=f"HUNG: no progress for {quiet[likely]:.1f} s{self._while_exiting(likely)}",
                              hung=True)
        dump_id = 0
        likely_cause = stopped[likely] or counters[likely] < max(counters.values())
        if self.answered is not None and not likely_cause:
            # another node found the hang first and our stacks are already taken for it: only
            # our own ranks' failure is left to report (a victim's request would only add noise)
            log.error("HUNG: local rank(s) %s made no progress for %.1f s (--hang-timeout=%g), as another "
                      "node found too", ", ".join(map(str, hung)), max(quiet.values()), self.watch.hang_timeout)
            dumps, path = self.answered
        else:
            log.error("HUNG: local rank(s) %s made no progress for %.1f s (--hang-timeout=%g); dumping the stacks "
                      "of every worker of the job", ", ".join(map(str, hung)), max(quiet.values()), self.watch.hang_timeout)
            try:
                dump_id = self._channel.request_stack_dump(asked)  # first: the other nodes dump while ours is taken
                self.dumps_seen = max(self.dumps_seen or 0, dump_id)  # ours: nothing to answer
            except RendezvousError as exc:
                log.warning("could not ask the other nodes for their stacks: %s", exc)
            dumps, path = self.watch.dump(pids, log_root, f"round{self.round}_hang",
                                           f"HUNG: local rank(s) {', '.join(map(str, hung))} (--hang-timeout="
                                           f"{self.watch.hang_timeout:g})")
        if dump_id:
            # the others' workers stay blocked where the hang left them until we kill ours
            missing = self._channel.await_dump_acknowledgements(dump_id, DUMP_TIMEOUT)
            if missing:
                log.warning("no stacks from node(s) %s within %g s", ", ".join(missing), DUMP_TIMEOUT)
        waiting = {lr: waits_on_peer(d.text) for lr, d in dumps.items()}
        order = order_hung(hung, counters, quiet, waiting, stopped)
        culprit = by_lr[order[0]]
        # likely a victim: it waits in a collective like its peers, is not stopped and not behind them
        blocked = (waiting.get(order[0], False) and not stopped[order[0]]
                   and counters[order[0]] >= max(counters.values()))
        log.error("HUNG: rank %d (local rank %d) made no progress for %.1f s%s%s; stacks in %s",
                  culprit.global_rank, order[0], quiet[order[0]], self._while_exiting(order[0]),
                  "; the other hung ranks wait behind it" if len(order) > 1 else "", path or "(no log directory)")
        failures = {}
        for idx, lr in enumerate(order):
            w = by_lr[lr]
            d = dumps.get(lr)
            stacks = f"stacks ({d.method}{': ' + d.reason if d.reason else ''}):\n{d.text.rstrip()}" if d else ""
            role = "" if idx == 0 else f" (blocked behind rank {culprit.global_rank})"
            detail = (f"HUNG{role}: no progress for {quiet[lr]:.1f} s (--hang-timeout={self.watch.hang_timeout:g})"
                      f"{self._while_exiting(lr)}; "
                      f"killed with SIGKILL; all stacks: {path or 'not written'}\n{stacks}")
            # went quiet at now - quiet; the culprit first among equals
            failures[w.global_rank] = ProcessFailure(
                local_rank=lr, global_rank=w.global_rank, pid=w.pid or -1, exitcode=-signal.SIGKILL,
                timestamp=now - quiet[lr] + idx * 1e-3, hostname=self._hostname, detail=detail)
        # a hung worker may ignore SIGTERM (or be stopped)
        return Alarm("hang", failures, kill=signal.SIGKILL, culprit=culprit.global_rank, blocked=blocked)

    def _while_exiting(self, local_rank: int) -> str:
        """``", hung while exiting (...)"`` for a rank whose teardown outlived its grace; "" otherwise."""
        seconds = self.watch.exiting_for(local_rank)
        if seconds is None:
            return ""
        return (f", hung while exiting (its program ended; its teardown has not finished {seconds:.1f} s "
                f"later, over the {exit_grace(self.watch.hang_timeout):g} s allowed)")
