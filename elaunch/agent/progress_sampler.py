"""The progress gauges' source for ``--metrics-port``: when each local rank's ``elaunch.progress()`` counter last moved.

``elaunch.progress()`` writes no time per call (it costs one add and no system call), so the
agent dates a call when it sees the counter move. The agent's own progress watch
(:mod:`elaunch.agent.progress_watch`) stops looking once its events are written, to
keep an idle agent asleep; the metrics need a look all along, so with
``--metrics-port`` a :class:`ProgressSampler` reads the mapped counters from a thread
of its own (:attr:`ProgressSampler.thread`, started and stopped by the agent's
supervisor). Stdlib only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from elaunch.supervision import HelperThread

#: Seconds between the sampler's looks at the counters: the most ``elaunch_progress_age_seconds``
#: can read short (a look costs no system call).
SAMPLE_EVERY = 1.0


class ProgressSampler:
    """Per local rank: how long since its ``elaunch.progress()`` counter last changed, and its last step.

    ``elaunch.progress()`` writes no time per call (it costs one add and no system call), so a call is
    dated when the agent sees the counter move: a daemon thread reads the mapped counters every
    :data:`SAMPLE_EVERY` seconds (no system call), and each scrape reads them once more. The age
    a scrape reports is thus at most ``SAMPLE_EVERY`` seconds short of the true one, never long:
    a rank that stopped calling shows its quiet time. A counter at 0 (no call since the group
    started: the files are zeroed for each group) has no age.

    Args:
        files: returns the node's ``ProgressFiles`` (``read()``, ``steps()``), or None.
        every: seconds between the thread's looks.
        clock: monotonic seconds (injectable for tests).

    Attributes:
        thread: the sampling thread (a ``elaunch.supervision.HelperThread``, a daemon: it never holds the
            agent's exit), for the run's supervisor to start and stop; :meth:`table` works without it.
    """

    def __init__(self, files: Callable[[], Any], every: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._files, self._every, self._clock = files, SAMPLE_EVERY if every is None else every, clock
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # local rank -> (counter, when it was first seen at it)
        self._steps: dict[int, int | None] = {}
        self.thread = HelperThread("progress sampler", self._run, thread_name="elaunch-progress-sampler")

    def sample(self) -> None:
        """Read the counters and steps once; a counter seen at a new value is dated now."""
        files = self._files()
        if files is None:
            return
        try:
            counters, steps = files.read(), files.steps()
        except (ValueError, RuntimeError):  # the files are being closed under us: the run ends
            return
        now = self._clock()
        with self._lock:
            for lr, value in counters.items():
                seen = self._seen.get(lr)
                if seen is None or seen[0] != value:
                    self._seen[lr] = (value, now)
            self._steps = steps

    def table(self) -> dict[int, tuple[float | None, int | None]]:
        """Local rank -> ``(seconds since its counter last moved or None before a call, last step or None)``."""
        self.sample()
        now = self._clock()
        with self._lock:
            return {lr: (now - at if value > 0 else None, self._steps.get(lr))
                    for lr, (value, at) in sorted(self._seen.items())}

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self._every):
            self.sample()
