"""The agent's side of in-process restart: interrupt the survivors, keep them over the rejoin, send "go".

:class:`InProcess` is one of the agent's watchdogs (``agent.watchdog.Watchdog``): it gives
every worker the channel's name (:meth:`InProcess.env`) and, at each look of the monitor,
reads what the workers said; a worker that reports ``raised`` fails the group (an
:class:`~elaunch.agent.watchdog.Alarm` of kind ``"raised"``) as its exit would. The agent
then calls, in order, on a failure that :meth:`InProcess.applies` to:

1. :meth:`InProcess.interrupt`: "abort" to every running worker not waiting yet; hand each dead
   worker's warm spare its environment at once (``prestart``: it waits in the wrapper for the
   next round's "go", like a survivor); wait up to ``grace`` seconds (``--inprocess-timeout``)
   for each survivor to say "ready"; dump the stacks of those that did not (``on_late``) and
   SIGKILL them (they are replaced like dead ones).
2. the agent decides and counts the restart as for any failure (``JobView.decide``);
3. on RESTART, :meth:`InProcess.keep`: the waiting workers are released from the attempt
   (``WorkerProcesses.release``) and held here while the agent joins the next round;
   on any other step the agent stops them as today;
4. :meth:`InProcess.adopter`, the next attempt's first ``adopt`` hook: a kept worker of a
   local rank is sent "go" with that worker's full environment and log files and runs
   the attempt's rank, and so does a replacement started in step 1; the other ranks start as
   new processes (a warm spare when there is one); :meth:`InProcess.started` then writes the
   ``inprocess_restart`` event.

The decisions are :mod:`elaunch.inprocess.decide`'s. torchrun stops every worker on any
failure. Stdlib only.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from subprocess import Popen
from typing import TYPE_CHECKING

from elaunch.inprocess import decide
from elaunch.inprocess.channel import GONE, Channel
from elaunch.inprocess.wire import CONTROL_ENV, PRESTART_ENV

if TYPE_CHECKING:
    from elaunch.procs import AttemptLogs, WorkerProcesses

log = logging.getLogger("elaunch.agent")


class InProcess:
    """In-process restart for one agent run (see the module docstring).

    Args:
        channel: the run's control channel, opened and supervised; None: not offered (every
            failure restarts every worker, as torchrun).
        events: the run's ``AgentEvents`` (``inprocess_restart`` events).
        grace: seconds an interrupted worker has to say "ready" before it is killed.
        raised_alarm: makes the watchdog's alarm for a "raised" (the agent's ``Alarm("raised", {})``:
            this package does not import the agent's); None: a "raised" raises no alarm.
        on_late: called with ``{local rank: pid}`` of the workers not ready within ``grace``, before
            they are killed; returns where their stacks were written (the agent's stack dump), or None.
        clock: ``time.monotonic`` (injectable for tests).

    Attributes:
        polls, interval: the watchdog's (False, None: a "raised" wakes the monitor itself).
    """

    polls = False
    interval = None

    def __init__(self, channel: Channel | None, events, grace: float,
                 raised_alarm: Callable[[], object] | None = None, clock: Callable[[], float] = time.monotonic,
                 on_late: Callable[[dict[int, int]], str | None] | None = None) -> None:
        self._channel = channel
        self._raised_alarm = raised_alarm
        self._on_late = on_late
        self._events = events
        self._grace = grace
        self._clock = clock
        self._pids: dict[int, int] = {}  # local rank -> pid of the running attempt
        self._hello: set[int] = set()  # pids that opted in
        self._waiting: set[int] = set()  # pids that said "ready" (round torn down) since their last "go"
        self._raised: dict[int, tuple[str, float]] = {}  # pid -> (error, arrival), reported while the round ran
        self._gone: dict[int, float] = {}  # pid -> when its connection ended (its death, if it died)
        self._kept: dict[int, subprocess.Popen] = {}  # local rank -> a released survivor
        self._prestarted: dict[int, subprocess.Popen] = {}  # local rank -> a dead worker's replacement, waiting
        self._fault_at: float | None = None
        self._cause = "failure"
        self._go_sent: list[int] = []  # local ranks of the survivors sent "go"
        self._pre_sent: list[int] = []  # local ranks of the replacements started before the round, sent "go"

    @property
    def offered(self) -> bool:
        """True while the channel is offered (given, and its thread has not died)."""
        return self._channel is not None

    def turned_off(self) -> None:
        """The channel's thread died (the supervisor's ``OFF`` policy): failures restart every worker from now on."""
        self._channel = None

    # ------------------------------------------------------------ Watchdog

    def env(self, local_rank: int) -> dict[str, str]:
        """``ELAUNCH_CONTROL``: the channel's name, the same for every worker of the run ({} when not offered)."""
        return {CONTROL_ENV: self._channel.address} if self._channel is not None else {}

    def new_attempt(self, round: int) -> None:
        """Nothing: :meth:`started` learns the attempt's pids."""

    def poll(self, watched) -> "object | None":
        """Read the workers' messages; an ``Alarm("raised")`` when one reported that its ``main()`` raised."""
        self._read()
        if not self._raised or self._raised_alarm is None:
            return None
        ranks = sorted(lr for lr, pid in self._pids.items() if pid in self._raised)
        log.warning("in-process restart: local rank(s) %s raised (%s)", ranks,
                    "; ".join(self._raised[self._pids[lr]][0] for lr in ranks))
        return self._raised_alarm()

    def close(self, grace: float = 0.0) -> None:
        """End the survivors still kept (the agent ends between a failure and the next attempt). Idempotent.

        Args:
            grace: seconds the kept workers have to exit (after :meth:`forward`'s signal) before SIGKILL;
                0: SIGKILL at once. Each kept worker's end is logged with how it ended.
        """
        deadline = self._clock() + grace
        for proc in self._kept.values():
            try:
                proc.wait(max(0.0, deadline - self._clock()))
            except subprocess.TimeoutExpired:
                pass
        kept = dict(self._kept)
        self.drop()
        for lr, proc in sorted(kept.items()):
            code = proc.returncode
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            log.warning("in-process restart: local rank %d's kept worker %d, waiting for the next round, ended (%s)",
                        lr, proc.pid, how)

    def forward(self, sig: int) -> None:
        """Send ``sig`` to each kept worker's process group: the agent was signalled while they waited for the
        next round (torchrun forwards its signal to every worker; :meth:`close` then gives them the grace)."""
        for proc in self._kept.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    # ------------------------------------------------------------ the agent's steps

    def started(self, procs: "WorkerProcesses", workers) -> None:
        """A new attempt runs ``procs``: read only its workers; wake the monitor on "raised"; log a restart in process.

        Args:
            procs: the attempt's processes (survivors adopted, new ones started).
            workers: the attempt's ``Worker`` list (global ranks for the event).
        """
        self._pids = dict(procs.pids)
        self._raised.clear()
        if self._channel is None:
            return
        self._channel.expect(self._pids.values())
        self._channel.wake = procs.wakeup
        if self._fault_at is not None:
            kept = set(self._go_sent)
            ranks = {w.local_rank: w.global_rank for w in workers}
            # until the kept got "go" and the new ones started (not the next attempt's spares after it)
            seconds = min(self._clock(), procs.started_at) - self._fault_at
            world = workers[0].world_size if workers else None
            self._events.emit("inprocess_restart", kept=sorted(ranks[lr] for lr in kept),
                              started=sorted(g for lr, g in ranks.items() if lr not in kept), seconds=round(seconds, 3),
                              cause=self._cause, world_size=world,
                              prestarted=sorted(ranks[lr] for lr in self._pre_sent if lr in ranks))
            log.warning("in-process restart: %d worker(s) kept their processes, %d started, %.2f s after the %s"
                        " (world size %s)", len(kept), len(ranks) - len(kept), seconds,
                        "fault" if self._cause == "failure" else "membership change", world)
        self._fault_at, self._go_sent, self._pre_sent = None, [], []

    def applies(self, codes: Mapping[int, int | None], fixable: bool) -> bool:
        """Whether this failure goes in process (:func:`decide.goes_in_process`; reads the messages first)."""
        self._read()
        opted = [lr for lr, pid in self._pids.items() if pid in self._hello]
        return decide.goes_in_process(list(codes), opted, fixable, self._channel is not None)

    def keeps_peers(self) -> bool:
        """True while every worker of the running attempt opted in: a hang verdict kills only its culprit."""
        self._read()
        opted = [lr for lr, pid in self._pids.items() if pid in self._hello]
        return decide.goes_in_process(list(self._pids), opted, True, self._channel is not None)

    def raised(self) -> list[int]:
        """Local ranks that reported "raised" while the round ran (before any abort): failures to count."""
        return sorted(self.raised_errors())

    def raised_errors(self) -> dict[int, str]:
        """Local rank -> the exception it reported (``"RuntimeError: ..."``) while the round ran; see :meth:`raised`."""
        return {lr: self._raised[pid][0] for lr, pid in self._pids.items() if pid in self._raised}

    def death_times(self, exits: Mapping[int, float]) -> dict[int, float]:
        """``exits`` (local rank -> when the agent saw its exit), each dated no later than its control
        connection's end: a killed worker's sockets close as it dies, and its peers' "raised" (their
        collectives broke on those sockets) arrives after that, though often before the exit is seen."""
        self._read()
        return {lr: min(at, self._gone.get(self._pids.get(lr), at)) for lr, at in exits.items()}

    def raised_times(self) -> dict[int, float]:
        """Local rank -> when its "raised" arrived (seconds since the epoch): the failure's time, as an exit's is
        when the agent saw it; a raised worker writes no error file of its own (``@record`` still may).
        See :func:`decide.failure_times` for a death seen just after. Reads the channel's new messages first."""
        self._read()
        return {lr: self._raised[pid][1] for lr, pid in self._pids.items() if pid in self._raised}

    def interrupt(self, procs: "WorkerProcesses",
                  prestart: "Callable[[int, dict[str, str]], Popen | None] | None" = None) -> list[int]:
        """End the round in process: "abort" to the running workers; SIGKILL those not ready in time.

        Args:
            procs: the attempt's processes.
            prestart: ``(local rank, extra env) -> process or None``: hands that rank's next warm spare
                the dead worker's environment plus ``extra_env`` (``GroupStarter.prestart``); called for
                each worker that opted in and is dead (or killed here), so that its replacement runs the
                script up to the wrapper while the agents decide and re-form. None: replacements start
                with the next attempt.

        Returns:
            The local ranks to keep (running, waiting for "go"), sorted.
        """
        self._fault_at = self._clock()
        waiting = self._waiting_ranks()
        for lr in decide.laggards(procs.poll(), waiting):
            if not self._channel.send(self._pids[lr], {"op": "abort"}) and procs.poll().get(lr) is None:
                log.warning("in-process restart: local rank %d cannot be told to stop its round", lr)
        self._prestart_dead(procs, prestart)
        deadline = self._clock() + self._grace
        while True:
            self._read()
            late = decide.laggards(procs.poll(), self._waiting_ranks())
            if not late:
                break
            left = deadline - self._clock()
            if left <= 0:
                # RUNNING -> KILLED: not ready within the grace; replaced like a dead worker. Their stacks first:
                # where a survivor hangs (an abort that never returns) is what its log cannot say
                stacks = self._late_stacks(late)
                log.warning("in-process restart: local rank(s) %s not ready within %.1f s; killing them%s", late,
                            self._grace, f" (their stacks: {stacks})" if stacks else "")
                procs.notify(signal.SIGKILL, late)
                procs.wait(1.0)
                self._wait_dead(procs, late)
                self._prestart_dead(procs, prestart)
                break
            procs.wait(min(left, 0.05))
        return decide.kept(procs.poll(), self._waiting_ranks())

    def _prestart_dead(self, procs: "WorkerProcesses", prestart) -> None:
        """Start the replacement of each dead worker that opted in and has none yet (see :meth:`interrupt`)."""
        if prestart is None or self._channel is None:
            return
        for lr, code in sorted(procs.poll().items()):
            if code is None or lr in self._prestarted or self._pids.get(lr) not in self._hello:
                continue
            try:
                proc = prestart(lr, {PRESTART_ENV: "1"})
            except OSError as exc:  # the rank starts with the next attempt instead
                log.warning("in-process restart: local rank %d's replacement cannot be started early: %s", lr, exc)
                continue
            if proc is not None:
                log.debug("in-process restart: local rank %d's replacement %d started before the round", lr,
                          proc.pid)
                self._prestarted[lr] = proc
        if self._prestarted:  # their "hello" is read, and a "go" is queued for one not connected yet
            self._channel.expect({*self._pids.values(), *(p.pid for p in self._prestarted.values())})

    def _late_stacks(self, late: list[int]) -> str | None:
        """Where the stacks of ``late`` (local ranks) were written by ``on_late``; None: not dumped."""
        if self._on_late is None:
            return None
        try:
            return self._on_late({lr: self._pids[lr] for lr in late if lr in self._pids})
        except Exception as exc:  # noqa: BLE001 - a diagnosis must not keep the restart from going on
            log.warning("in-process restart: the late workers' stacks could not be dumped: %s", exc)
            return None

    def keep(self, procs: "WorkerProcesses", local_ranks: list[int], cause: str = "failure") -> None:
        """Release ``local_ranks``' workers from ``procs`` and hold them for the next attempt.

        Args:
            procs: the attempt's processes.
            local_ranks: the waiting survivors (:meth:`interrupt`'s result).
            cause: ``"failure"`` (a restart, counted) or ``"membership"`` (a re-form, not counted: a node lost
                or waiting to join, a round failed elsewhere; the survivors get new ranks when the world
                changed); written in the ``inprocess_restart`` event.
        """
        self._cause = cause
        self._kept.update(procs.release(local_ranks))

    def adopter(self, logs: "AttemptLogs") -> "Callable[[int, list[str], dict[str, str]], Popen | None] | None":
        """The next attempt's first ``adopt`` hook: a kept worker gets "go" and runs its local rank.

        A replacement started before the round (:meth:`interrupt`'s ``prestart``) gets its "go" the
        same way; queued by the channel when it has not reached the wrapper yet. Returns None when no
        worker is kept or started.
        """
        if not self._kept and not self._prestarted:
            return None

        def adopt(local_rank: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen | None:
            early = local_rank not in self._kept
            proc = (self._prestarted if early else self._kept).pop(local_rank, None)
            if proc is None:
                return None
            go = {"op": "go", "env": dict(env), "stdout": logs.stdout.get(local_rank),
                  "stderr": logs.stderr.get(local_rank)}
            if proc.poll() is None and self._channel is not None and self._channel.send(proc.pid, go, queue=early):
                self._waiting.discard(proc.pid)
                (self._pre_sent if early else self._go_sent).append(local_rank)
                return proc
            log.warning("in-process restart: local rank %d's %s %d is gone; starting it anew", local_rank,
                        "replacement started before the round" if early else "kept worker", proc.pid)
            _kill(proc)
            return None

        return adopt

    def drop(self) -> None:
        """Kill and reap every kept survivor, and every replacement started before the round, not handed a
        rank (the job ends, the failure is not restarted, or the next attempt did not use it)."""
        kept = [*self._kept.values(), *self._prestarted.values()]
        self._kept, self._prestarted = {}, {}
        for proc in kept:
            _kill(proc)

    # ------------------------------------------------------------ helpers

    def _read(self) -> None:
        """Take the channel's messages; what a pid says counts only while it is one of the attempt's workers."""
        if self._channel is None:
            return
        current = set(self._pids.values()) | {p.pid for p in (*self._kept.values(), *self._prestarted.values())}
        for pid, msg, at in self._channel.take():
            if pid not in current:
                continue
            op = msg["op"]
            if op == "hello":
                self._hello.add(pid)
            elif op == "raised":  # main() raised; "ready" follows once its round is torn down
                if self._fault_at is None:  # during the round: a failure; after the abort: its effect
                    self._raised[pid] = (msg["error"], at)
            elif op == "ready":
                self._waiting.add(pid)
            elif op == GONE:
                self._gone[pid] = at

    def _waiting_ranks(self) -> set[int]:
        return {lr for lr, pid in self._pids.items() if pid in self._waiting}

    def _wait_dead(self, procs: "WorkerProcesses", local_ranks: list[int]) -> None:
        deadline = self._clock() + 10.0
        while self._clock() < deadline and any(procs.poll().get(lr) is None for lr in local_ranks):
            procs.wait(0.1)


def open_inprocess(supervisor, run_id: str, events, grace: float, raised_alarm: Callable[[], object],
                   offered: bool = True, on_late: Callable[[dict[int, int]], str | None] | None = None) -> InProcess:
    """In-process restart for one run: its channel opened and added to ``supervisor``, when ``offered``.

    Args:
        supervisor: the run's ``elaunch.supervision.Supervisor`` (the channel is a helper of
            tier ``THREADS``, policy ``OFF``: when its thread dies the run goes on with full restarts).
        run_id: the job's id (part of the channel's name).
        events: the run's ``AgentEvents``.
        grace: seconds an interrupted worker has to be ready (``--inprocess-timeout``).
        raised_alarm: the watchdog alarm a "raised" fails the group with (see :class:`InProcess`).
        offered: False: no channel (function workers); every failure restarts every worker.
        on_late: see :class:`InProcess`.

    A channel that cannot be opened is logged once and not offered (never fatal).
    """
    from elaunch.supervision import OFF, THREADS

    if not offered:
        return InProcess(None, events, grace, raised_alarm)
    channel = Channel(run_id)
    try:
        channel.open()
    except OSError as exc:
        log.warning("in-process restart is off: its control channel cannot be opened: %s", exc)
        return InProcess(None, events, grace, raised_alarm)
    inproc = InProcess(channel, events, grace, raised_alarm, on_late=on_late)
    supervisor.add(channel, THREADS, on_death=OFF, wakes=False, turned_off=inproc.turned_off,
                   note="in-process restart is off; failures restart every worker")
    return inproc


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a kept worker's process group and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10.0)
    except subprocess.TimeoutExpired:
        log.error("kept worker %d could not be reaped", proc.pid)
