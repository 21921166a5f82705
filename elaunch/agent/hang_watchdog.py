"""The ``--hang-timeout`` watchdog: find hung workers, dump stacks, answer other nodes' stack-dump requests.

Workers call ``elaunch.progress()`` each step; it bumps a counter in a file the
agent's progress watch (``agent.progress_watch``) creates per local rank
(``procs.progress_files``). :class:`HangWatchdog` reads the counters at each poll
(no system call), the pure verdict ``decide.hung_ranks`` names the ranks that went quiet, and the Python stacks of
every worker are dumped with py-spy (or the faulthandler fallback, ``procs.stacks``)
into the log directory: on a hang here, and when another node (or ``elaunch
status``) asks through the rendezvous. A hang comes back as an
:class:`~elaunch.agent.watchdog.Alarm`: the hung workers as failures, the rank the
others wait behind first (``decide.order_hung``), SIGKILL for them. torchrun has
no such check (pytorch#122694: a hung job shows no stack).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping

from elaunch.agent.decide import exit_grace, hang_suspects, hung_ranks, order_hung
from elaunch.agent.published import stacks_record
from elaunch.agent.watchdog import Alarm, Watched
from elaunch.procs import _proctree
from elaunch.rendezvous.contract import FailureRecord, JobState, RendezvousError, RendezvousHandler
from elaunch.rendezvous.job_channel import publish
from elaunch.spec import ProcessFailure

log = logging.getLogger("elaunch.agent")

#: Seconds one worker's stack dump may take (py-spy, then the fallback: twice at most).
DUMP_TIMEOUT = 10.0


class HangWatchdog:
    """One agent's hang watch and response, attempt after attempt: a watchdog.

    Args:
        hang_timeout: seconds without progress (after a first ``elaunch.progress()``)
            that make a rank hung; 0 turns detection off (only stack-dump requests are
            answered, and only when something else makes the monitor look).
        local_ranks: this node's local ranks.
        rdzv: the rendezvous handler (its job channel carries stack-dump requests and their answers).
        hostname: this node's name, for failures.
        clock: monotonic seconds (injectable for tests).
        progress: the node's progress watch (its files and their watch are read here), which the
            agent polls as a watchdog of its own; None: with ``hang_timeout > 0`` this watchdog
            makes and owns one (no events), without it there are no files and stack dumps use
            py-spy only.

    Attributes:
        polls: True when ``--hang-timeout`` is on (stack-dump requests come with the rendezvous' polling).
        interval: None: no shorter interval than ``--monitor-interval``.
        dumps_seen: the job's stack-dump requests answered (None: not read yet this attempt).
        answered: this round's stacks taken for another node's request, or None.
        round: the rendezvous round of the attempt.

    Raises:
        OSError: the progress files cannot be created.
    """

    def __init__(self, hang_timeout: float, local_ranks: range | list[int], rdzv: RendezvousHandler,
                 hostname: str, clock: Callable[[], float] = time.monotonic, progress=None) -> None:
        self.hang_timeout = hang_timeout
        self._channel = rdzv.job_channel()
        self._hostname = hostname
        self._clock = clock
        self.polls = hang_timeout > 0
        self.interval = None
        self.dumps_seen: int | None = None
        self.answered: tuple[dict, str | None] | None = None
        self.round = -1
        self._exit_seen: dict[int, float] = {}  # local rank -> when its exit mark was first seen
        self._exiting: dict[int, float] = {}  # local rank -> seconds exiting, as of the last check
        self._own = progress is None and hang_timeout > 0  # this watchdog gives the workers their files
        if self._own:
            from elaunch.agent.progress_watch import ProgressWatchdog

            progress = ProgressWatchdog(local_ranks, clock=clock)
        self._progress = progress
        self._files = progress.files if progress is not None else None
        self._watch = progress.watch if progress is not None else None

    def env(self, local_rank: int) -> dict[str, str]:
        """Variables for ``local_rank``'s worker (``ELAUNCH_PROGRESS_FILE``...) when this watchdog owns the files."""
        return self._progress.env(local_rank) if self._own else {}

    def new_attempt(self, round: int) -> None:
        """Forget the last attempt's hang facts (the files are zeroed by their owner, the progress watch)."""
        if self._own:
            self._progress.new_attempt(round)
        self._exit_seen, self._exiting = {}, {}
        self.dumps_seen, self.answered, self.round = None, None, round

    def close(self) -> None:
        """Remove the progress files when this watchdog owns them. Idempotent."""
        if self._own:
            self._progress.close()

    def poll(self, watched: Watched) -> Alarm | None:
        """Answer the job's stack-dump requests, then return the alarm of a hang (None: none).

        A quiet rank that wrote its error file is failing (it raised and is still
        exiting): an alarm without failures, the exit codes tell. A hang while the job
        failed elsewhere is no alarm: that failure decides.
        """
        ranks = {w.local_rank: w.global_rank for w in watched.group.workers}
        self.answer(watched.job, watched.pids, watched.log_root, ranks)
        hung = self.hung(watched.codes)
        if not hung:
            return None
        if any(watched.error_files.get(lr) and os.path.exists(watched.error_files[lr]) for lr in hung):
            # HEALTHY -> FAILED: quiet because it is failing (it raised and is still exiting), not hung
            return Alarm("hang", {})
        if watched.job.failed:
            return None
        return self.on_hang(hung, watched.group.workers, watched.log_root)

    def hung(self, exit_codes: Mapping[int, int | None]) -> list[int]:
        """Return the local ranks that hang now (sorted); [] when detection is off.

        A rank's quiet is measured on this agent's monotonic clock from the first
        reading that saw its counter change: a late check (a loaded machine) can
        only see more progress, never less. A worker whose exit mark names a live
        process is exiting, from the first check that saw the mark on: see
        ``decide.hung_ranks``.
        """
        if self._files is None or self.hang_timeout <= 0:
            return []
        now = self._clock()
        table = self._watch.update(self._files.read(), now, self._files.steps())
        progress = {lr: (p.ever_reported, p.seconds_since_last_change) for lr, p in table.items()}
        # a mark counts while its process is exiting; a rank whose exit code is known needs no look
        marked = [lr for lr, pid in self._files.exit_marks().items()
                  if exit_codes.get(lr) is None and _proctree.exists(pid)]
        self._exiting = {lr: now - self._exit_seen.setdefault(lr, now) for lr in marked}
        hung = hung_ranks(progress, exit_codes, self.hang_timeout, self._exiting)
        if not hung or self._exiting:
            return hung  # an exiting rank is judged alone: its peers' quiet waits on it
        return hang_suspects(hung, progress, exit_codes, self.hang_timeout)

    def exiting_for(self, local_rank: int) -> float | None:
        """Seconds ``local_rank``'s worker has been exiting as of the last check; None when it was not."""
        return self._exiting.get(local_rank)

    def counter(self, local_rank: int) -> int:
        """``local_rank``'s progress counter as last read (0 when unknown)."""
        row = self._watch.table().get(local_rank) if self._watch is not None else None
        return row.counter if row is not None else 0

    def quiet_for(self, local_rank: int) -> float:
        """Seconds since ``local_rank`` last made progress (0 when unknown)."""
        row = self._watch.table().get(local_rank) if self._watch is not None else None
        return row.seconds_since_last_change if row is not None else 0.0

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
            dumps, path = self.dump(pids, log_root, f"round{self.round}_status", why)
            log.info("%s; this node's worker stacks are in %s", why, path or "(no log directory)")
            publish(self._channel, "stacks", stacks_record(job.dump_id, self.round, self._hostname, dumps, pids,
                                                        ranks or {}, path))
            self._channel.acknowledge_dump(job.dump_id)
            return
        why = f"stacks requested through the rendezvous: rank {by.rank} on {by.host} hangs"
        dumps, path = self.dump(pids, log_root, f"round{self.round}_requested", why)
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
        quiet = {lr: self.quiet_for(lr) for lr in hung}
        counters = {lr: self.counter(lr) for lr in by_lr}
        stopped = {lr: process_state(by_lr[lr].pid or -1) in ("T", "t") for lr in hung}
        likely = order_hung(hung, counters, quiet, {}, stopped)[0]  # before the stacks tell more
        if self.answered is not None and not (stopped[likely] or counters[likely] < max(counters.values())):
            # another node found the hang first and our stacks are already taken for it: only
            # our own ranks' failure is left to report (a victim's request would only add noise)
            log.error("HUNG: local rank(s) %s made no progress for %.1f s (--hang-timeout=%g), as another "
                      "node found too", ", ".join(map(str, hung)), max(quiet.values()), self.hang_timeout)
            dumps, path = self.answered
        else:
            dumps, path = self._dump_everywhere(hung, by_lr, likely, quiet, log_root, now)
        waiting = {lr: waits_on_peer(d.text) for lr, d in dumps.items()}
        order = order_hung(hung, counters, quiet, waiting, stopped)
        culprit = by_lr[order[0]]
        # likely a victim: it waits in a collective like its peers, is not stopped and not behind them
        blocked = (waiting.get(order[0], False) and not stopped[order[0]]
                   and counters[order[0]] >= max(counters.values()))
        log.error("HUNG: rank %d (local rank %d) made no progress for %.1f s%s%s; stacks in %s",
                  culprit.global_rank, order[0], quiet[order[0]], self._while_exiting(order[0]),
                  "; the other hung ranks wait behind it" if len(order) > 1 else "", path or "(no log directory)")
        failures = self._failures(order, by_lr, quiet, dumps, path, now)
        # a hung worker may ignore SIGTERM (or be stopped)
        return Alarm("hang", failures, kill=signal.SIGKILL, culprit=culprit.global_rank, blocked=blocked,
                     stopped=stopped[order[0]], quiet_seconds=max(quiet.values()))

    def _dump_everywhere(self, hung: list[int], by_lr: Mapping, likely: int, quiet: Mapping[int, float],
                         log_root: str | None, now: float) -> tuple[dict, str | None]:
        """Ask every node for its stacks (naming ``likely``), dump ours, wait for theirs; (dumps, path) of ours."""
        first = by_lr[likely]
        asked = FailureRecord(round=self.round, at=now, host=self._hostname, rank=first.global_rank,
                              local_rank=likely, pid=first.pid or -1, exitcode=-signal.SIGKILL,
                              message=f"HUNG: no progress for {quiet[likely]:.1f} s{self._while_exiting(likely)}",
                              hung=True)
        log.error("HUNG: local rank(s) %s made no progress for %.1f s (--hang-timeout=%g); dumping the stacks "
                  "of every worker of the job", ", ".join(map(str, hung)), max(quiet.values()), self.hang_timeout)
        dump_id = 0
        try:
            dump_id = self._channel.request_stack_dump(asked)  # first: the other nodes dump while ours is taken
            self.dumps_seen = max(self.dumps_seen or 0, dump_id)  # ours: nothing to answer
        except RendezvousError as exc:
            log.warning("could not ask the other nodes for their stacks: %s", exc)
        pids = {lr: w.pid or -1 for lr, w in by_lr.items()}
        dumps, path = self.dump(pids, log_root, f"round{self.round}_hang",
                                f"HUNG: local rank(s) {', '.join(map(str, hung))} (--hang-timeout={self.hang_timeout:g})")
        if dump_id:
            # the others' workers stay blocked where the hang left them until we kill ours
            missing = self._channel.await_dump_acknowledgements(dump_id, DUMP_TIMEOUT)
            if missing:
                log.warning("no stacks from node(s) %s within %g s", ", ".join(missing), DUMP_TIMEOUT)
        return dumps, path

    def _failures(self, order: list[int], by_lr: Mapping, quiet: Mapping[int, float], dumps: Mapping,
                  path: str | None, now: float) -> dict[int, ProcessFailure]:
        """The hung workers' failures (global rank ->), the culprit ``order[0]`` first, its stacks in each."""
        culprit = by_lr[order[0]]
        failures = {}
        for idx, lr in enumerate(order):
            w = by_lr[lr]
            d = dumps.get(lr)
            stacks = f"stacks ({d.method}{': ' + d.reason if d.reason else ''}):\n{d.text.rstrip()}" if d else ""
            role = "" if idx == 0 else f" (blocked behind rank {culprit.global_rank})"
            detail = (f"HUNG{role}: no progress for {quiet[lr]:.1f} s (--hang-timeout={self.hang_timeout:g})"
                      f"{self._while_exiting(lr)}; "
                      f"killed with SIGKILL; all stacks: {path or 'not written'}\n{stacks}")
            # went quiet at now - quiet; the culprit first among equals
            failures[w.global_rank] = ProcessFailure(
                local_rank=lr, global_rank=w.global_rank, pid=w.pid or -1, exitcode=-signal.SIGKILL,
                timestamp=now - quiet[lr] + idx * 1e-3, hostname=self._hostname, detail=detail)
        return failures

    def _while_exiting(self, local_rank: int) -> str:
        """``", hung while exiting (...)"`` for a rank whose teardown outlived its grace; "" otherwise."""
        seconds = self.exiting_for(local_rank)
        if seconds is None:
            return ""
        return (f", hung while exiting (its program ended; its teardown has not finished {seconds:.1f} s "
                f"later, over the {exit_grace(self.hang_timeout):g} s allowed)")

    def dump(self, pids: Mapping[int, int], log_root: str | None, label: str, why: str) -> tuple[dict, str | None]:
        """Dump the Python stacks of every worker; write them under ``log_root/stacks/`` (:func:`write_stacks`,
        with this run's stacks files for the faulthandler fallback)."""
        files = self._files.stacks_files() if self._files is not None else None
        return write_stacks(pids, files, log_root, label, why)


def write_stacks(pids: Mapping[int, int], files: Mapping[int, str] | None, log_root: str | None, label: str,
                 why: str) -> tuple[dict, str | None]:
    """Dump the Python stacks of the processes ``pids``; write them to ``log_root/stacks/<label>_<ms>.txt``.

    Args:
        pids: local rank -> worker pid (running workers).
        files: local rank -> the worker's stacks file (``ProgressFiles.stacks_files()``), for the
            faulthandler fallback; None: py-spy only.
        log_root: the run's log directory (None or ``os.devnull``: not written).
        label: names the file, e.g. ``"round3_rank2"``.
        why: the first line of the file (what asked for the dump).

    Returns:
        (local rank -> ``StackDump``, the file written or None). Takes up to about
        ``2 * DUMP_TIMEOUT`` seconds (``procs.stacks.dump_stacks``); never raises for a process that
        cannot be read.
    """
    from elaunch.procs.stacks import dump_stacks, process_state

    states = {lr: process_state(pid) for lr, pid in pids.items()}  # before py-spy touches them
    dumps = dump_stacks(pids, files, DUMP_TIMEOUT)
    path = None
    if log_root and log_root != os.devnull:
        path = os.path.join(log_root, "stacks", f"{label}_{int(time.time() * 1000)}.txt")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(why + "\n\n" + format_dumps(dumps, pids, states))
        except OSError as exc:
            log.warning("could not write the stacks to %s: %s", path, exc)
            path = None
    return dumps, path


#: Frames that show a worker blocked in a collective, waiting for its peers (py-spy and
#: faulthandler both print the file path): ``torch.distributed`` (a collective, a barrier),
#: and the autograd engine, where DistributedDataParallel's gradient all-reduce waits (its
#: reducer runs in C++ under ``backward``: no ``torch/distributed`` frame is on the stack).
_COLLECTIVE_MARKERS = ("torch/distributed/", "torch\\distributed\\", "torch/autograd/", "torch\\autograd\\")


def waits_on_peer(stack_text: str) -> bool:
    """True when a dumped stack shows the worker inside ``torch.distributed`` or a backward pass (DDP's all-reduce)."""
    return any(marker in stack_text for marker in _COLLECTIVE_MARKERS)


def format_dumps(dumps: Mapping, pids: Mapping[int, int], states: Mapping[int, str] | None = None) -> str:
    """Return the dumps as text: a header per local rank (pid, stopped or not, method) and its stacks."""
    parts = []
    states = states or {}
    for lr in sorted(dumps):
        d = dumps[lr]
        how = d.method + (f" ({d.reason})" if d.reason else "")
        stopped = ", STOPPED (SIGSTOP or a debugger)" if states.get(lr) in ("T", "t") else ""
        parts.append(f"--- local rank {lr} (pid {pids.get(lr, '?')}{stopped}), stacks by {how}\n{d.text.rstrip()}\n")
    return "\n".join(parts)
