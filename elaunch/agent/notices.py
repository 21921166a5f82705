"""Forwarded signals (``--forward-signals``): the handler records them, the agent's loop acts.

A notice (Slurm's SIGUSR1 before the time limit) is forwarded to the workers, asks
the checkpoint keeper for a persist, and is written to the event log and the
agent's log. None of that runs in the signal handler: a handler runs in the main
thread between any two bytecodes, so work there interleaves with whatever the
loop was doing (an event half written, an observer's lock held, a worker group
being stopped). The handler only appends to a queue and writes one byte to the
running group's wake pipe (``WorkerProcesses.wakeup``); the monitor's wait returns
at once and polls this object first of its watchdogs, which hands each queued
notice to the agent. A notice that arrives while no group is watched (during a
rendezvous, a start or a stop) is handled at the next look, or when the run ends.

torchrun has no notices: SIGUSR1 is not among the signals it handles. Stdlib only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

#: ``act(signum, at, target)``: ``at`` the time it arrived (seconds since the epoch), ``target``
#: what the agent recorded with it (the worker group running then, or None).
Act = Callable[[int, float, Any], None]


class Notices:
    """The notices received and not yet acted on; a watchdog that never alarms, polled first by the monitor.

    Args:
        act: called by :meth:`take` (the agent's main thread, never a handler) with each
            notice in the order received: ``act(signum, at, target)``.
        clock: seconds since the epoch, read when a notice is recorded (injectable for tests).

    Attributes:
        polls: False: a notice wakes the monitor itself (:meth:`record`); nothing to look at on a clock.
        interval: None, as ``polls``.
    """

    polls = False
    interval = None

    def __init__(self, act: Act, clock: Callable[[], float] = time.time) -> None:
        self._act = act
        self._clock = clock
        self._pending: deque[tuple[int, float, Any]] = deque()
        self._wake: Callable[[], None] | None = None

    def wake_with(self, wake: Callable[[], None] | None) -> None:
        """Have :meth:`record` call ``wake`` (async-signal-safe: a self-pipe write), or nothing (None).

        The agent sets the running group's ``WorkerProcesses.wakeup`` once it started, and
        None before it stops the group (its pipe is closed then).
        """
        self._wake = wake

    def record(self, signum: int, target: Any = None) -> None:
        """Queue one notice and wake the monitor; the only part that runs in the signal handler.

        Args:
            signum: the signal received.
            target: what :meth:`take` passes on with it (the agent: the workers running now).
        """
        self._pending.append((signum, self._clock(), target))  # deque.append: atomic, no lock
        wake = self._wake
        if wake is not None:
            wake()

    def pending(self) -> int:
        """How many notices are queued (not yet acted on)."""
        return len(self._pending)

    def take(self) -> int:
        """Act on every queued notice, oldest first (main thread); return how many."""
        n = 0
        while True:
            try:
                signum, at, target = self._pending.popleft()
            except IndexError:
                return n
            self._act(signum, at, target)
            n += 1

    # -- the Watchdog interface (agent.watchdog.Watchdog) -------------------------------------------------------

    def env(self, local_rank: int) -> dict[str, str]:
        """No variables for the workers."""
        return {}

    def new_attempt(self, round: int) -> None:
        """Nothing to forget: a queued notice keeps the group it arrived for."""

    def poll(self, watched=None) -> None:
        """Act on the queued notices (:meth:`take`); never an alarm."""
        self.take()
        return None

    def close(self) -> None:
        """Nothing held."""
