"""The progress watch: the node's progress files, read for the event log's ``training`` and ``caught_up``.

Every agent that runs workers gives each one a progress file
(:class:`~elaunch.procs.progress_files.ProgressFiles`; ``elaunch.progress()``
bumps it), with or without ``--hang-timeout``. This watchdog owns the files and
their :class:`~elaunch.procs.progress_files.ProgressWatch`; the hang watchdog
judges hangs from the same ones (only with ``--hang-timeout > 0``). It writes:

- ``training`` once per attempt, when every local rank has called
  ``elaunch.progress()`` (dated by the workers' own first-call times, so however
  late the agent looks, the line's ``time`` is when the last rank first reported);
- ``caught_up`` once the node's highest reported step reaches the highest step
  it had reached before the last stop (only when steps are reported);

and answers the step a group stopped at (the ``step`` of ``worker_exited`` and
``restart``). These make the goodput ledger's starting and restoring time
(:mod:`elaunch.agent.ledger`).

Cost: three reads of mapped words per rank per look, no system call. It asks the
monitor to look only while an event is pending: until ``training``, at most every
:data:`MAX_LOOK` seconds (backing off from ``--monitor-interval``; the workers' first-call
times date the event), and after a stop at a known step, every ``--monitor-interval``
until ``caught_up``. Then it asks for nothing: a standalone job's agent goes back
to sleeping until a worker exits. Stdlib only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from elaunch.agent.watchdog import Alarm, Watched
from elaunch.procs.progress_files import ProgressFiles, ProgressWatch

log = logging.getLogger("elaunch.agent")

#: The most seconds between two looks while waiting for ``training`` without a step to catch up to.
MAX_LOOK = 5.0


class ProgressWatchdog:
    """The node's progress files and the events read from them, attempt after attempt: a watchdog.

    Args:
        local_ranks: this node's local ranks.
        events: the node's event log (an ``AgentEvents``), or None to write no events.
        interval: ``--monitor-interval``, seconds: the first wait for ``training``, and the
            look while catching up.
        clock: monotonic seconds (injectable for tests).

    Attributes:
        files: the progress files (``ELAUNCH_PROGRESS_FILE`` of each worker).
        watch: their :class:`ProgressWatch` (shared with the hang watchdog).
        polls: True while catching up (``caught_up`` pending after ``training``): look every
            ``--monitor-interval``.
        interval: None (no shorter interval).
        look_within: while ``training`` is pending and nothing else polls, the most seconds until the
            next look (None: nothing pending).

    Raises:
        OSError: the progress files cannot be created.
    """

    interval = None

    def __init__(self, local_ranks: Iterable[int], events=None, interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.files = ProgressFiles(local_ranks)
        self.watch = ProgressWatch()
        self._events = events
        self._interval = interval
        self._clock = clock
        self._high: int | None = None  # the highest step this node reached, over every attempt so far
        self._target: int | None = None  # the step to catch up to in this attempt (None: not behind)
        self._group_high: int | None = None  # the highest step seen in this attempt
        self._training = False  # this attempt's ``training`` is written
        self._running = False  # an attempt's workers were started and not yet stopped
        self._wait = interval

    @property
    def polls(self) -> bool:
        return self._running and self._training and self._target is not None

    @property
    def look_within(self) -> float | None:
        if not self._running or self._training:
            return None
        return self._interval if self._target is not None else self._wait

    def env(self, local_rank: int) -> dict[str, str]:
        """``ELAUNCH_PROGRESS_FILE`` (and the stacks file and signal) of ``local_rank``'s worker."""
        return self.files.env(local_rank)

    def new_attempt(self, round: int) -> None:
        """A new set of workers: zero the files; the step reached so far becomes the one to catch up to."""
        self.files.reset()
        self.watch.reset()
        self._target = self._high
        self._group_high = None
        self._training = False
        self._running = True
        self._wait = self._interval

    def poll(self, watched: Watched) -> Alarm | None:
        """Read the files; write ``training`` / ``caught_up`` when due. Never an alarm."""
        if not self._running or (self._training and self._target is None):
            return None
        self._steps()
        if not self._training:
            first = self.files.first_calls()
            waiting = [w.local_rank for w in watched.group.workers
                       if w.local_rank not in first and watched.codes.get(w.local_rank) is None]
            if waiting or not first:
                self._wait = min(self._wait * 2, MAX_LOOK)
                return None
            self._training = True
            if self._events is not None:
                self._events.training(self._group_high, at=max(first.values()))
        if self._target is not None and self._group_high is not None and self._group_high >= self._target:
            self._target = None
            if self._events is not None:
                self._events.caught_up(self._group_high)
        return None

    def _steps(self) -> int | None:
        """Read the steps; the highest this attempt (None: no rank gave one)."""
        steps = [s for s in self.files.steps().values() if s is not None]
        if steps:
            top = max(steps)
            self._group_high = top if self._group_high is None else max(self._group_high, top)
        return self._group_high

    def stopped(self) -> int | None:
        """The group stopped: the highest step it reported (None: none), remembered as the node's to catch up to.

        Call after the workers exited and before the next :meth:`new_attempt`.
        """
        if not self._running:
            return None
        self._running = False
        step = self._steps()
        if step is not None:
            self._high = step if self._high is None else max(self._high, step)
        return step

    def close(self) -> None:
        """Remove the progress files. Idempotent."""
        self.files.close()


def open_progress_watch(local_ranks: Iterable[int], events, interval: float,
                        required: bool) -> ProgressWatchdog | None:
    """The agent's progress watch; None (one warning) when its files cannot be made and no hang watch needs them.

    Raises:
        OSError: the files cannot be made and ``required`` (hang detection is on: hangs could not be seen).
    """
    try:
        return ProgressWatchdog(local_ranks, events, interval)
    except OSError as exc:
        if required:
            raise
        log.warning("no progress files (%s): no training/caught_up events, the goodput ledger counts no "
                    "starting or restoring time", exc)
        return None
